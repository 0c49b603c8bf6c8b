"""Engine: the model, its tokenizer, telemetry, the model runner and the scheduler, wired together.

`generate()` is the offline entry point (`swa-runtime generate`, benchmarks, tests): it queues every prompt
and steps the scheduler until all are done. The server drives the same scheduler from its own thread.
"""

from __future__ import annotations

import torch

from runtime.config import EngineConfig
from runtime.core import Req
from runtime.executor.model_runner import DTYPES, ModelRunner
from runtime.faults import Faults
from runtime.layers.sampler import SamplingParams
from runtime.models.loader import load_model
from runtime.models.tokenizer import load_tokenizer
from runtime.scheduler.scheduler import Scheduler
from telemetry.logging import EventReporter
from telemetry.ratelimit import RateLimiter
from telemetry.stats import EngineStats


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
        self.runner = ModelRunner(cfg, model, self.stats, self.reporter, Faults.parse(cfg.inject), progress)
        self.pool = self.runner.pool
        self.scheduler = Scheduler(self.runner, self.stats, self.tokenizer.eos_token_ids,
                                   torch.Generator().manual_seed(cfg.seed), cfg.hicache_size)
        self.stats.kv_tokens_fn = self.kv_tokens

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 logits_out: list | None = None) -> list[list[int]]:
        """Output token ids per prompt. Every prompt is validated first (RequestError: nothing queued).
        With `logits_out` (a list), it receives per prompt a (new tokens, vocab) tensor of the sampled logits."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [Req(list(p), sp, logits=[] if logits_out is not None else None) for p, sp in zip(prompts, plist)]
        for r in reqs:
            self.scheduler.validate(r)
        for r in reqs:
            self.scheduler.add(r)
        try:
            while not all(r.done for r in reqs):
                if not self.scheduler.step():
                    raise RuntimeError("scheduler made no progress with requests pending")
        finally:
            for r in reqs:
                if not r.done:
                    self.scheduler.abort(r.rid)
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
