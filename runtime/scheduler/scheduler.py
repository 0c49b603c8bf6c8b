"""Continuous batching over the hybrid pools.

Each `step()` runs at most one forward: a prefill (extend) batch when some admitted request still has
prompt to prefill, otherwise one decode step for every running request. Prompts are prefilled in chunks of
at most `chunked_prefill_size` tokens. After every forward, tokens that left every window give back their
SWA slots. When a decode step cannot get slots, the newest request is retracted: its KV goes to the host
tier if there is room (loaded back into new slots later, with the mapping rebuilt and re-registered),
otherwise it is dropped and recomputed. Requests are validated at `add()` so that nothing admitted can
need more than the pools hold: the engine never deadlocks on pool exhaustion.

Not thread-safe: one thread (the engine's) calls everything here.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from runtime.core import Req, RequestError
from runtime.executor.forward_batch import ForwardBatch
from runtime.layers.sampler import sample
from runtime.mem_cache.hicache import HostKVCache


class Scheduler:
    def __init__(self, runner, stats, eos_ids, generator: torch.Generator | None = None, hicache_size: int = 0):
        self.runner = runner
        self.cfg = runner.cfg
        self.pool = runner.pool
        self.alloc = runner.pool.allocator
        self.req_to_token = runner.req_to_token
        self.stats = stats
        self.eos_ids = set(eos_ids)
        self.generator = generator
        mc = runner.model_config
        self.vocab_size = mc.vocab_size
        self.window = mc.sliding_window if mc.sliding_layer_ids else None
        self.hicache = HostKVCache(self.pool, hicache_size)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admitted: they hold a request row and KV slots
        self.by_rid: dict[str, Req] = {}
        stats.queue_fn = lambda: (len(self.running), len(self.waiting))

    # ---- public ------------------------------------------------------------------------------------------
    def validate(self, req: Req) -> None:
        """Raise RequestError for a request that can never be served as asked."""
        ids = req.prompt_ids
        if not ids:
            raise RequestError("empty prompt: give at least one token")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise RequestError(f"token ids must be integers within [0, {self.vocab_size})")
        total = len(ids) + req.params.max_new_tokens
        if total > self.runner.context_length:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_new_tokens ({req.params.max_new_tokens}) "
                               f"exceeds the context length of {self.runner.context_length} tokens")
        if total + self.cfg.page_size > self.alloc.full.size:
            raise RequestError(f"request needs up to {total} KV slots; the full pool holds "
                               f"{self.alloc.full.size} (raise --max-total-tokens)")

    def add(self, req: Req) -> None:
        try:
            self.validate(req)
        except RequestError as exc:
            req.status, req.error = "rejected", str(exc)
            self.stats.record_request("rejected")
            raise
        req.status = "waiting"
        self.waiting.append(req)
        self.by_rid[req.rid] = req

    def abort(self, rid: str) -> bool:
        req = self.by_rid.get(rid)
        if req is None or req.done:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "aborted", "abort")
        return True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def step(self) -> bool:
        """Run at most one forward. Returns False when there was nothing to do."""
        self._admit()
        prefill = [r for r in self.running if r.cached < self._prefill_target(r)]
        if prefill and self._prefill(prefill):
            return True
        decode = [r for r in self.running if r.cached >= self._prefill_target(r)]
        if decode:
            self._decode(decode)
            return True
        if len(prefill) > 1:
            # Partly prefilled requests fill the pools and none can go on: make room by retracting one.
            self._retract(prefill[-1])
            return True
        return False

    def assert_idle_clean(self) -> None:
        """Both pools fully free, no mapping entry, no request row held (for tests and diagnostics)."""
        assert not self.running and not self.waiting, "requests are still queued or running"
        a = self.alloc
        assert a.full.available_size() == a.full.size, "full-pool slots leaked"
        assert a.swa.available_size() == a.swa.size, "SWA-pool slots leaked"
        assert int((a.full_to_swa_index_mapping[:-1] != 0).sum()) == 0, "mapping entries left"
        assert self.req_to_token.available() == self.cfg.max_running_requests, "request rows leaked"
        assert self.hicache.used == 0, "host-cache tokens leaked"

    # ---- admission ---------------------------------------------------------------------------------------
    @staticmethod
    def _prefill_target(r: Req) -> int:
        """Tokens to cache before decoding: the prompt, or (after a recompute retraction) all but the last."""
        return len(r.prompt_ids) if not r.output_ids else len(r.all_ids()) - 1

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_running_requests:
            r = self.waiting[0]
            if r.offloaded is not None:
                if self.req_to_token.available() == 0:
                    return
                locs = self.hicache.load_back(r.offloaded)
                if locs is None:
                    return
                r.offloaded = None
                r.row = self.req_to_token.alloc()
                self.req_to_token.write(r.row, 0, locs)
                r.locs = locs.tolist()
                self.stats.add_hicache_loadbacks(1)
            else:
                # admit only if its first chunk could be allocated now
                first = min(self._prefill_target(r), self.cfg.chunked_prefill_size, self.alloc.available_size())
                if first < 1 or self.req_to_token.available() == 0:
                    return
                r.row = self.req_to_token.alloc()
                if not r.output_ids and r.first_token_time is None:
                    self.stats.add_prompt_tokens(len(r.prompt_ids))
            r.status = "running"
            self.waiting.popleft()
            self.running.append(r)

    # ---- forwards ----------------------------------------------------------------------------------------
    def _prefill(self, reqs: list[Req]) -> bool:
        budget, chosen, prefix, seq, last = self.cfg.chunked_prefill_size, [], [], [], []
        for r in reqs:
            n = min(self._prefill_target(r) - r.cached, budget)
            while n > 0 and not self.alloc.can_extend(prefix + [r.cached], seq + [r.cached + n]):
                n //= 2
            if n <= 0:
                break
            chosen.append(r)
            prefix.append(r.cached)
            seq.append(r.cached + n)
            last.append(r.locs[-1] if r.locs else -1)
            budget -= n
            if budget <= 0:
                break
        if not chosen:
            return False
        locs = self.alloc.alloc_extend(prefix, seq, last)
        assert locs is not None  # checked by can_extend above
        ids = [t for r, p, s in zip(chosen, prefix, seq) for t in r.all_ids()[p:s]]
        positions = [i for p, s in zip(prefix, seq) for i in range(p, s)]
        self._record_locs(chosen, prefix, seq, locs)
        batch = ForwardBatch(False, torch.tensor(ids), torch.tensor(positions), locs, [r.row for r in chosen],
                             prefix, seq)
        logits = self.runner.forward(batch)
        self._release_window(chosen)
        ready = [i for i, r in enumerate(chosen) if r.cached == self._prefill_target(r) and not r.output_ids]
        if ready:
            self._append_tokens([chosen[i] for i in ready], logits[ready])
        return True

    def _decode(self, reqs: list[Req]) -> None:
        while True:
            seq = [r.cached + 1 for r in reqs]
            locs = self.alloc.alloc_decode(seq, [r.locs[-1] for r in reqs])
            if locs is not None:
                break
            victim = reqs.pop()  # the newest admitted
            self._retract(victim)
            if not reqs:
                return
        prefix = [r.cached for r in reqs]
        ids = [r.all_ids()[p] for r, p in zip(reqs, prefix)]
        self._record_locs(reqs, prefix, seq, locs)
        batch = ForwardBatch(True, torch.tensor(ids), torch.tensor(prefix), locs, [r.row for r in reqs], prefix, seq)
        logits = self.runner.forward(batch)
        self._release_window(reqs)
        self._append_tokens(reqs, logits)

    def _append_tokens(self, reqs: list[Req], logits: torch.Tensor) -> None:
        tokens = sample(logits, [r.params for r in reqs], self.generator)
        now = time.perf_counter()
        for r, t, row in zip(reqs, tokens, logits):
            r.output_ids.append(t)
            if r.logits is not None:
                r.logits.append(row.float().cpu())
            if r.first_token_time is None:
                r.first_token_time = now
                self.stats.ttft.observe(now - r.arrival_time)
            else:
                self.stats.itl.observe(now - r.last_token_time)
            r.last_token_time = now
            self.stats.add_generation_tokens(1)
            if r.on_token is not None:
                r.on_token(r, t)
            if len(r.output_ids) >= r.params.max_new_tokens:
                self._finish(r, "finished", "length")
            elif t in self.eos_ids and not r.params.ignore_eos:
                self._finish(r, "finished", "stop")

    # ---- slots -------------------------------------------------------------------------------------------
    def _record_locs(self, reqs: list[Req], prefix: list[int], seq: list[int], locs: torch.Tensor) -> None:
        offset = 0
        for r, p, q in zip(reqs, prefix, seq):
            new = locs[offset:offset + q - p]
            offset += q - p
            self.req_to_token.write(r.row, p, new)
            r.locs.extend(new.tolist())

    def _release_window(self, reqs: list[Req]) -> None:
        """Give back SWA slots of tokens no future query can see (position <= cached - window)."""
        if self.window is None:
            return
        ps = self.cfg.page_size
        for r in reqs:
            cut = r.cached - self.window + 1
            if cut <= r.swa_released_upto:
                continue
            freed = self.alloc.free_swa(torch.tensor(r.locs[r.swa_released_upto:cut]))
            self.stats.add_evicted_tokens(freed)
            r.swa_released_upto = cut // ps * ps

    def _retract(self, r: Req) -> None:
        """Take a running request's KV off the device: to host memory if it fits, else drop it."""
        self.running.remove(r)
        if self.hicache.can_hold(len(r.locs)):
            r.offloaded = self.hicache.offload(r.locs, r.swa_released_upto)
            self.stats.add_hicache_offloads(1)
        else:
            r.swa_released_upto = 0  # recompute from scratch
        self._free_slots(r)
        r.status = "waiting"
        self.waiting.appendleft(r)

    def _free_slots(self, r: Req) -> None:
        if r.locs:
            self.alloc.free(torch.tensor(r.locs))
            r.locs = []
        if r.row > 0:
            self.req_to_token.free(r.row)
            r.row = -1

    def _finish(self, r: Req, status: str, reason: str) -> None:
        if r in self.running:
            self.running.remove(r)
        self._free_slots(r)
        if r.offloaded is not None:
            self.hicache.drop(r.offloaded)
            r.offloaded = None
        r.status, r.finish_reason = status, reason
        self.by_rid.pop(r.rid, None)
        self.stats.record_request(status)
        if status == "finished":
            self.stats.e2e.observe(time.perf_counter() - r.arrival_time)
        if r.on_finish is not None:
            r.on_finish(r)
