"""Offline engine: load a model, then generate for a list of prompts (prefill in chunks, batched decode).

This is the simple loop behind `swa-runtime generate` and the benchmarks: every request is admitted at
once (the pools must hold them all), prompts are prefilled in chunks of at most `chunked_prefill_size`
tokens, all running requests decode together, and tokens that left every window give back their SWA slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.config import EngineConfig
from runtime.executor.forward_batch import ForwardBatch
from runtime.executor.model_runner import DTYPES, ModelRunner
from runtime.faults import Faults
from runtime.layers.sampler import SamplingParams, sample
from runtime.models.loader import load_model
from runtime.models.tokenizer import load_tokenizer
from telemetry.logging import EventReporter
from telemetry.ratelimit import RateLimiter
from telemetry.stats import EngineStats


class CapacityError(RuntimeError):
    """The request cannot be served with the configured pools or context length."""


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    row: int = -1
    locs: list[int] = field(default_factory=list)  # full slot of each cached position
    output_ids: list[int] = field(default_factory=list)
    swa_released_upto: int = 0  # positions below this gave back their SWA slots
    finished: bool = False
    logits: list[torch.Tensor] | None = None  # per sampled token, when asked for (tests, diagnostics)

    @property
    def cached(self) -> int:
        return len(self.locs)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class Engine:
    def __init__(self, cfg: EngineConfig, progress: bool = True, model=None, tokenizer=None):
        """`model` (and `tokenizer`) may be given pre-built, e.g. a test's model with a chosen window."""
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        if model is None:
            _, model = load_model(cfg.model, dtype=DTYPES[cfg.dtype], device=cfg.device, progress=progress)
        self.model_config = model.config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model)
        self.stats = EngineStats(cfg.loc_cache, model=str(cfg.model), backend=cfg.attention_backend)
        self.reporter = EventReporter(self.stats, RateLimiter(interval_s=60.0))
        self.runner = ModelRunner(cfg, model, self.stats, self.reporter, Faults.parse(cfg.inject))
        self.pool = self.runner.pool
        self.window = self.model_config.sliding_window if self.model_config.sliding_layer_ids else None
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.stats.kv_tokens_fn = self.kv_tokens

    # ---- public ------------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 logits_out: list | None = None) -> list[list[int]]:
        """Output token ids per prompt. Raises CapacityError (nothing leaked) if they cannot all fit.
        With `logits_out` (a list), it receives per prompt a (new tokens, vocab) tensor of the logits sampled."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [Request(list(p), sp, logits=[] if logits_out is not None else None) for p, sp in zip(prompts, plist)]
        self._check_capacity(reqs)
        try:
            for r in reqs:
                r.row = self.runner.req_to_token.alloc()
            self._prefill(reqs)
            running = [r for r in reqs if not r.finished]
            while running:
                self._decode(running)
                running = [r for r in running if not r.finished]
        finally:
            for r in reqs:
                self._release(r)
        if logits_out is not None:
            logits_out.extend(torch.stack(r.logits) for r in reqs)
        return [r.output_ids for r in reqs]

    def kv_tokens(self) -> dict[tuple[str, str], int]:
        a = self.pool.allocator
        out = {}
        for name, alloc in (("full", a.full), ("swa", a.swa)):
            out[name, "total"] = alloc.size
            out[name, "available"] = alloc.available_size()
            out[name, "used"] = alloc.used_size()
        return out

    # ---- steps -------------------------------------------------------------------------------------------
    def _check_capacity(self, reqs: list[Request]) -> None:
        for r in reqs:
            if not r.prompt_ids:
                raise ValueError("empty prompt: give at least one token")
            total = len(r.prompt_ids) + r.params.max_new_tokens
            if total > self.runner.context_length:
                raise CapacityError(f"prompt ({len(r.prompt_ids)}) + max_new_tokens ({r.params.max_new_tokens}) "
                                    f"exceeds the context length {self.runner.context_length}")
            if any(not 0 <= t < self.model_config.vocab_size for t in r.prompt_ids):
                raise ValueError(f"token ids must be within [0, {self.model_config.vocab_size})")
        if len(reqs) > self.runner.req_to_token.available():
            raise CapacityError(f"{len(reqs)} requests exceed --max-running-requests {self.cfg.max_running_requests}")
        full_need = sum(len(r.prompt_ids) + r.params.max_new_tokens + self.cfg.page_size for r in reqs)
        if full_need > self.pool.allocator.full.available_size():
            raise CapacityError(f"requests need up to {full_need} full-pool tokens; "
                                f"{self.pool.allocator.full.available_size()} available (raise --max-total-tokens)")

    def _prefill(self, reqs: list[Request]) -> None:
        pending = list(reqs)
        while pending:
            budget, chosen, lens = self.cfg.chunked_prefill_size, [], []
            for r in pending:
                n = min(len(r.prompt_ids) - r.cached, budget)
                if n <= 0:
                    break
                chosen.append(r)
                lens.append(n)
                budget -= n
            logits = self._extend(chosen, lens)
            done = [r for r, n in zip(chosen, lens) if r.cached == len(r.prompt_ids)]
            if done:
                idx = [chosen.index(r) for r in done]
                self._append_tokens(done, logits[idx])
            pending = [r for r in pending if r.cached < len(r.prompt_ids)]

    def _extend(self, reqs: list[Request], lens: list[int]) -> torch.Tensor:
        prefix = [r.cached for r in reqs]
        seq = [p + n for p, n in zip(prefix, lens)]
        last = [r.locs[-1] if r.locs else -1 for r in reqs]
        locs = self.pool.allocator.alloc_extend(prefix, seq, last)
        if locs is None:
            raise CapacityError("KV pool exhausted during prefill (the SWA pool must hold a prefill chunk plus "
                                "the window of every running request): lower --chunked-prefill-size or raise pools")
        ids = [t for r, p, s in zip(reqs, prefix, seq) for t in r.all_ids()[p:s]]
        positions = [i for p, s in zip(prefix, seq) for i in range(p, s)]
        self._record_locs(reqs, prefix, seq, locs)
        batch = ForwardBatch(False, torch.tensor(ids), torch.tensor(positions), locs,
                             [r.row for r in reqs], prefix, seq)
        logits = self.runner.forward(batch)
        self._release_window(reqs)
        return logits

    def _decode(self, reqs: list[Request]) -> None:
        prefix = [r.cached for r in reqs]
        seq = [p + 1 for p in prefix]
        locs = self.pool.allocator.alloc_decode(seq, [r.locs[-1] for r in reqs])
        if locs is None:
            raise CapacityError("KV pool exhausted during decode")
        ids = [r.all_ids()[p] for r, p in zip(reqs, prefix)]
        self._record_locs(reqs, prefix, seq, locs)
        batch = ForwardBatch(True, torch.tensor(ids), torch.tensor(prefix), locs, [r.row for r in reqs], prefix, seq)
        logits = self.runner.forward(batch)
        self._release_window(reqs)
        self._append_tokens(reqs, logits)

    def _append_tokens(self, reqs: list[Request], logits: torch.Tensor) -> None:
        tokens = sample(logits, [r.params for r in reqs], self.generator)
        eos = set(self.tokenizer.eos_token_ids)
        for r, t, row in zip(reqs, tokens, logits):
            r.output_ids.append(t)
            if r.logits is not None:
                r.logits.append(row.float().cpu())
            if len(r.output_ids) >= r.params.max_new_tokens or (t in eos and not r.params.ignore_eos):
                r.finished = True
                self._release(r)

    # ---- slots -------------------------------------------------------------------------------------------
    def _record_locs(self, reqs: list[Request], prefix: list[int], seq: list[int], locs: torch.Tensor) -> None:
        offset = 0
        for r, p, q in zip(reqs, prefix, seq):
            new = locs[offset:offset + q - p]
            offset += q - p
            self.runner.req_to_token.write(r.row, p, new)
            r.locs.extend(new.tolist())

    def _release_window(self, reqs: list[Request]) -> None:
        """Give back SWA slots of tokens no future query can see (position <= seq_len - window)."""
        if self.window is None:
            return
        for r in reqs:
            cut = r.cached - self.window + 1
            if cut <= r.swa_released_upto:
                continue
            freed = self.pool.allocator.free_swa(torch.tensor(r.locs[r.swa_released_upto:cut]))
            self.stats.add_evicted_tokens(freed)
            ps = self.cfg.page_size
            r.swa_released_upto = cut // ps * ps

    def _release(self, r: Request) -> None:
        if r.locs:
            self.pool.allocator.free(torch.tensor(r.locs))
            r.locs = []
        if r.row > 0:
            self.runner.req_to_token.free(r.row)
            r.row = -1
