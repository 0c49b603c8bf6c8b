"""Continuous batching over the hybrid pools: which tokens run next, and what follows from the results.

The engine's step is `schedule()` -> run the forward and sample -> `process()`. `schedule()` admits waiting
requests and plans at most one forward: a prefill (extend) batch when some admitted request still has prompt
to prefill, otherwise one decode step for every running request; prompts are prefilled in chunks of at most
`chunked_prefill_size` tokens. `process()` appends the sampled tokens, finishes requests, and gives back the
SWA slots of tokens that left every window. When a decode step cannot get slots, the newest request is
retracted: its KV goes to the host tier if there is room (loaded back into new slots later, with the mapping
rebuilt and re-registered), otherwise it is dropped and recomputed. Requests are validated at `add()` so
that nothing admitted can need more than the pools hold: the engine never deadlocks on pool exhaustion.

With the prefix cache on, admission matches the request's tokens against the cache: the cached prefix's slots
become the head of `Req.locs`, held (locked) for the request and owned by the cache, and prefill starts after
them (at least one token is always computed, for its logits). The scheduler frees and window-evicts only the
slots it owns exclusively, those after the held prefix; a finished request's KV goes to the cache instead of
being freed.

Slots are planned through `KVSlots` (plain integers); nothing here touches a tensor, the model or the
sampler. Not thread-safe: one thread (the engine's) calls everything here.
"""

from __future__ import annotations

import time
from collections import deque

from runtime.config import ResolvedConfig
from runtime.core import Req, RequestError
from runtime.mem_cache.paths import SCHEDULER_PATHS
from runtime.mem_cache.slots import KVSlots, PrefixMatch
from runtime.scheduler.batch import ScheduledBatch


class Scheduler:
    def __init__(self, rc: ResolvedConfig, slots: KVSlots, stats, eos_ids, tracer=None, speculator=None):
        """`tracer`: an EngineTracer told of each request's arrival, admission, retraction and end (None:
        tracing off). `speculator` (runtime/speculative/speculator.py): draft tokens for decode steps, verified
        in one forward; None decodes one token a step."""
        cfg = rc.engine
        self.tracer = tracer
        self.slots = slots
        self.stats = stats
        self.eos_ids = set(eos_ids)
        self.window = rc.window
        self.context_length = rc.context_length
        self.vocab_size = rc.vocab_size
        self.chunk = cfg.chunked_prefill_size
        self.max_running = cfg.max_running_requests
        self.free_rows = list(range(1, cfg.max_running_requests + 1))  # rows of the request table
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admitted: they hold a request row and KV slots
        self.by_rid: dict[str, Req] = {}
        self.holds: dict[Req, PrefixMatch] = {}  # cached prefixes held by running requests (the cache's slots)
        self.speculator = speculator
        self.path_counts = dict.fromkeys(SCHEDULER_PATHS, 0)  # runtime/mem_cache/paths.py

    # ---- requests ----------------------------------------------------------------------------------------
    def validate(self, req: Req) -> None:
        """Raise RequestError for a request that can never be served as asked."""
        ids = req.prompt_ids
        if not ids:
            raise RequestError("empty prompt: give at least one token")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise RequestError(f"token ids must be integers within [0, {self.vocab_size})")
        total = len(ids) + req.params.max_new_tokens
        if total > self.context_length:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_new_tokens ({req.params.max_new_tokens}) "
                               f"exceeds the context length of {self.context_length} tokens")
        if total + self.slots.page_size > self.slots.full_size:
            raise RequestError(f"request needs up to {total} KV slots; the full pool holds "
                               f"{self.slots.full_size} (raise --max-total-tokens)")

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
        if self.tracer is not None:
            self.tracer.request_arrived(req)

    def abort(self, rid: str, status: str = "aborted", reason: str = "abort", message: str | None = None) -> bool:
        """End a queued or running request now, freeing its slots: by the client (`aborted`) or because the
        engine failed it (`error`). False if it is unknown or already done."""
        req = self.by_rid.get(rid)
        if req is None or req.done:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
        if message is not None:
            req.error = message
        self._finish(req, status, reason)
        return True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def queue_sizes(self) -> tuple[int, int]:
        """(running, waiting), for the gauges."""
        return len(self.running), len(self.waiting)

    # ---- one step: schedule ... process ------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """Plan the next forward and give its tokens slots; None when nothing can run. Retracting requests
        to make room is part of planning, so it is retried a bounded number of times."""
        for _ in range(len(self.running) + len(self.waiting) + 1):
            self._admit()
            prefill = [r for r in self.running if r.cached < self._prefill_target(r)]
            batch = self._plan_prefill(prefill) if prefill else None
            if batch is not None:
                return batch
            decode = [r for r in self.running if r.cached >= self._prefill_target(r)]
            if decode:
                batch = self._plan_decode(decode)
                if batch is not None:
                    return batch
                continue  # every decode request was retracted: prefill may go on now
            if len(prefill) > 1:
                # Partly prefilled requests fill the pools and none can go on: make room by retracting one.
                self._retract(prefill[-1])
                continue
            return None
        return None

    def process(self, batch: ScheduledBatch, tokens: list[int]) -> None:
        """After the forward: one sampled token per entry of `batch.sample`, in that order."""
        self._release_window(batch.reqs)
        now = time.perf_counter()
        for i, t in zip(batch.sample, tokens):
            r = batch.reqs[i]
            if not r.done:  # it may have ended while its token was being sampled (e.g. a failed sample)
                self._append(r, t, now)

    def process_verify(self, batch: ScheduledBatch, emitted: list[list[int]]) -> None:
        """After a verify forward: per request, the tokens acceptance emitted (the accepted draft prefix and
        the target's own token). Tokens past the request's budget or its stop token are dropped; the slots of
        every input token whose KV is not kept are rolled back before the window moves on."""
        kept = []
        for r, p, d, tokens in zip(batch.reqs, batch.prefix_lens, batch.drafts, emitted):
            if r.done:
                kept.append([])
                continue
            self.speculator.record(r, len(d), len(tokens) - 1)  # acceptance emits the accepted drafts + one
            tokens = self._emittable(r, tokens)
            kept.append(tokens)
            self._roll_back(r, p + len(tokens))
        self._release_window(batch.reqs)
        now = time.perf_counter()
        for r, tokens in zip(batch.reqs, kept):
            for t in tokens:
                if r.done or self._append(r, t, now):
                    break

    def _emittable(self, r: Req, tokens: list[int]) -> list[int]:
        """The prefix of `tokens` the request takes: up to its token budget, through its first stop token."""
        room = r.params.max_new_tokens - len(r.output_ids)
        out = []
        for t in tokens[:max(room, 0)]:
            out.append(t)
            if t in self.eos_ids and not r.params.ignore_eos:
                break
        return out

    def _roll_back(self, r: Req, keep: int) -> None:
        """Keep the KV of positions 0..keep-1: free the request's later slots (rejected drafts) on both pools,
        whole pages only (a page the kept tokens still use stays held; its later slots are written again by
        the next step), through the allocator's hooked free at the `spec_rollback` site."""
        ps = self.slots.page_size
        cut = min(-(-keep // ps) * ps, len(r.locs))
        if cut < len(r.locs):
            self.slots.free(r.locs[cut:], site="spec_rollback")
            self.path_counts["spec_rollback"] += 1
        if keep < cut:  # on the kept page: held, but no token's now
            self.slots.unmap(r.locs[keep:cut], site="spec_rollback")
            self.path_counts["spec_rollback_page_kept"] += 1
        del r.locs[keep:]

    def _append(self, r: Req, t: int, now: float) -> bool:
        """Give the request its next token (timing, callbacks, finishing); True when it is done."""
        r.output_ids.append(t)
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
        return r.done

    def assert_idle_clean(self) -> None:
        """Both pools fully free, no mapping entry, no request row held (for tests and diagnostics)."""
        assert not self.running and not self.waiting, "requests are still queued or running"
        usage = self.slots.usage()
        assert usage["full", "available"] == usage["full", "total"], "full-pool slots leaked"
        assert usage["swa", "available"] == usage["swa", "total"], "SWA-pool slots leaked"
        tree = self.slots.tree  # the prefix cache may hold slots, none of them locked
        assert not self.holds and (tree is None or tree.locked_tokens == 0), "cached prefixes still held"
        assert self.slots.mapped_count() == (tree.swa_tokens if tree else 0), "mapping entries left"
        assert len(self.free_rows) == self.max_running, "request rows leaked"
        assert self.slots.host_used == (tree.host_tokens if tree else 0), "host-cache tokens leaked"

    # ---- admission ---------------------------------------------------------------------------------------
    @staticmethod
    def _prefill_target(r: Req) -> int:
        """Tokens to cache before decoding: the prompt, or (after a recompute retraction) all but the last."""
        return len(r.prompt_ids) if not r.output_ids else len(r.all_ids()) - 1

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running and self.free_rows:
            r = self.waiting[0]
            loaded = r.offloaded is not None
            if loaded:
                # with room for a decode step after it: else it would be retracted again at once
                locs = self.slots.load_back(r.offloaded, headroom=self.slots.page_size)
                if locs is None:
                    return
                r.offloaded = None
                r.locs = locs
                self.path_counts["loadback"] += 1
                self.stats.add_hicache_loadbacks(1)
            else:
                ids = r.all_ids()
                match = self.slots.match_prefix(ids, len(ids) - 1)  # held now: it must not be evicted
                cached = match.length if match is not None else 0
                # admit only if its first chunk (or decode step) could be allocated now
                first = min(max(self._prefill_target(r) - cached, 1), self.chunk, self.slots.available())
                if first < 1:
                    if match is not None:
                        self.slots.release_prefix(match)
                    return
                if cached:
                    self.holds[r] = match
                    r.locs, r.swa_released_upto = list(match.locs), cached
                if not r.output_ids and r.first_token_time is None:
                    self.stats.add_prompt_tokens(len(r.prompt_ids))
                    if match is not None:
                        self.stats.prefix_cache.record_lookup(len(r.prompt_ids), cached)
            r.row, r.row_fresh = self.free_rows.pop(0), True
            if loaded:  # new slots for every position, all its own
                self.slots.claim(r.locs, [r.row] * len(r.locs), list(range(len(r.locs))), {r.row: r.rid})
            self.slots.share(r.row, [] if loaded or not cached else list(match.locs))  # the cache slots it reads
            r.status = "running"
            self.waiting.popleft()
            self.running.append(r)
            if self.tracer is not None:
                self.tracer.request_admitted(r)

    # ---- planning ----------------------------------------------------------------------------------------
    def _plan_prefill(self, reqs: list[Req]) -> ScheduledBatch | None:
        budget, chosen, prefix, seq, last = self.chunk, [], [], [], []
        for r in reqs:
            n = min(self._prefill_target(r) - r.cached, budget)
            while n > 0 and not self.slots.can_extend(prefix + [r.cached], seq + [r.cached + n]):
                n //= 2
            if n <= 0:
                break
            chosen.append(r)
            self.path_counts["prefill_chunked"] += r.cached + n < self._prefill_target(r)
            prefix.append(r.cached)
            seq.append(r.cached + n)
            last.append(r.locs[-1] if r.locs else -1)
            budget -= n
            if budget <= 0:
                break
        if not chosen:
            return None
        locs = self.slots.alloc_extend(prefix, seq, last)
        assert locs is not None  # checked by can_extend above
        sample = tuple(i for i, (r, s) in enumerate(zip(chosen, seq))
                       if s == self._prefill_target(r) and not r.output_ids)
        return self._batch(chosen, False, prefix, seq, locs, sample)

    def _plan_decode(self, reqs: list[Req]) -> ScheduledBatch | None:
        """One decode step for `reqs`, with drafts to verify when speculating (without them if the pools
        cannot hold them); the newest request is retracted while not even one token each fits."""
        reqs = list(reqs)
        while reqs:
            prefix = [r.cached for r in reqs]
            last = [r.locs[-1] for r in reqs]
            drafts = self._drafts(reqs)
            if drafts:
                seq = [p + 1 + len(d) for p, d in zip(prefix, drafts)]
                locs = self.slots.alloc_extend(prefix, seq, last)
                if locs is not None:
                    self.path_counts["spec_verify"] += 1
                    return self._batch(reqs, False, prefix, seq, locs, tuple(range(len(reqs))), drafts)
            seq = [p + 1 for p in prefix]
            locs = self.slots.alloc_extend(prefix, seq, last)
            if locs is not None:
                return self._batch(reqs, True, prefix, seq, locs, tuple(range(len(reqs))))
            self._retract(reqs.pop())  # the newest admitted
        return None

    def _drafts(self, reqs: list[Req]) -> tuple[tuple[int, ...], ...]:
        """Per request the draft to verify (empty: decode it plainly); () when no request has one. A draft
        never asks for more tokens than the request may still emit, less the target's own. A request that
        asks for log probabilities decodes plainly (they are reported token by token, as each is sampled)."""
        if self.speculator is None:
            return ()
        drafts = tuple(() if r.params.logprobs is not None
                       else self.speculator.draft(r, r.params.max_new_tokens - len(r.output_ids) - 1) for r in reqs)
        return drafts if any(drafts) else ()

    def _batch(self, reqs: list[Req], is_decode: bool, prefix: list[int], seq: list[int], locs: list[int],
               sample: tuple[int, ...], drafts: tuple[tuple[int, ...], ...] = ()) -> ScheduledBatch:
        """Record the new slots on each request (its one record of them) and describe the forward."""
        fresh = tuple(r.row_fresh for r in reqs)
        offset, rows, positions = 0, [], []
        for r, p, s in zip(reqs, prefix, seq):
            r.locs.extend(locs[offset:offset + s - p])
            offset += s - p
            r.row_fresh = False
            rows += [r.row] * (s - p)
            positions += range(p, s)
        self.slots.claim(list(locs), rows, positions, {r.row: r.rid for r in reqs})  # each new slot to its token
        return ScheduledBatch(tuple(reqs), is_decode, tuple(prefix), tuple(seq), tuple(locs), sample, fresh, drafts)

    # ---- slots -------------------------------------------------------------------------------------------
    def _release_window(self, reqs) -> None:
        """Give back SWA slots of tokens no future query can see (position <= cached - window), or, with the
        prefix cache, that it will not keep. One release for the whole batch (one allocator call, one ledger
        update, one invalidation), not one per request: requests' pages are disjoint, so page rounding holds."""
        if self.window is None:
            return
        ps = self.slots.page_size
        leaving: list[int] = []
        for r in reqs:
            if r.done:
                continue
            if self.slots.tree is None:
                cut = r.cached - self.window + 1
            else:  # what the prefix cache will keep of this request's KV when it finishes (a page more)
                cut = self.slots.tree.keep_from(r.cached // ps * ps)
            if cut <= r.swa_released_upto:
                continue
            leaving += r.locs[r.swa_released_upto:cut]
            self.path_counts["window_release"] += 1
            r.swa_released_upto = cut // ps * ps
        if leaving:
            self.stats.add_evicted_tokens(self.slots.free_swa(leaving))

    def _retract(self, r: Req) -> None:
        """Take a running request's KV off the device: to host memory if it fits, else drop it."""
        self.running.remove(r)
        if self.slots.can_offload(len(r.locs)):
            swa_from = self._window_start(r)
            r.offloaded = self.slots.offload(r.locs, swa_from)
            r.swa_released_upto = swa_from
            self.stats.add_hicache_offloads(1)
            self.stats.record_retraction("offload")
            self.path_counts["retract_offload"] += 1
        else:
            r.swa_released_upto = 0  # recompute from scratch
            self.stats.record_retraction("recompute")
            self.path_counts["retract_recompute"] += 1
        if self.tracer is not None:
            self.tracer.request_retracted(r, "offload" if r.offloaded is not None else "recompute")
        self._free_slots(r)
        r.status = "waiting"
        self.waiting.appendleft(r)

    def _window_start(self, r: Req) -> int:
        """First position whose SWA slot the request still needs (page-aligned); all from there on are mapped.
        A held prefix's positions below `swa_released_upto` can be inside the window: the cache keeps them."""
        if self.window is None:
            return 0
        ps = self.slots.page_size
        return min(r.swa_released_upto, max(0, r.cached - self.window + 1) // ps * ps)

    def _free_slots(self, r: Req) -> None:
        """Free the request's own slots (after its held prefix) and release the prefix and its row."""
        hold = self.holds.pop(r, None)
        if r.locs:
            self.slots.free(r.locs[hold.length if hold else 0:])
            r.locs = []
        if hold is not None:
            self.slots.release_prefix(hold)
        if r.row > 0:
            self.free_rows.append(r.row)
            r.row = -1

    def _finish(self, r: Req, status: str, reason: str) -> None:
        if r in self.running:
            self.running.remove(r)
        if status == "finished" and r.locs and self.slots.tree is not None:
            # every slot in r.locs has its KV written (the forward ran): the cache takes them all
            ids = r.all_ids()[:r.cached]
            self.slots.cache_prefix(ids, r.locs, self.holds.pop(r, None), r.swa_released_upto)
            r.locs = []
            self.path_counts["finish_cache_prefix"] += 1
        elif status == "finished" and r.locs:
            self.path_counts["finish_free"] += 1
        self._free_slots(r)
        if r.offloaded is not None:
            self.slots.drop(r.offloaded)
            r.offloaded = None
        r.status, r.finish_reason = status, reason
        self.by_rid.pop(r.rid, None)
        if self.speculator is not None:
            self.speculator.finish(r)
        self.stats.record_request(status)
        if status == "finished":
            self.stats.e2e.observe(time.perf_counter() - r.arrival_time)
        if self.tracer is not None:
            self.tracer.request_finished(r)
        if r.on_finish is not None:
            r.on_finish(r)
