"""Engine: the model, its tokenizer, telemetry, the model runner and the scheduler, wired together.

`step()` is the whole engine loop body: the scheduler plans a batch, the runner runs the forward, the
engine samples, the scheduler processes the results. `generate()` is the offline entry point
(`swa-runtime generate`, benchmarks, tests): it queues every prompt and steps until all are done. The
server steps the same engine from its own thread.
"""

from __future__ import annotations

import time
from typing import Protocol

import structlog
import torch

from runtime import kernels
from runtime.config import EngineConfig
from runtime.core import Req, SamplingParams, TokenLogprob
from runtime.executor.forward_batch import ForwardBatch
from runtime.executor.model_runner import ModelRunner
from runtime.faults import Faults
from runtime.int_tensors import int_tensor
from runtime.layers.linear import ROW_BUCKET, packed_shapes, warm_row_counts
from runtime.layers.quantized import set_head_screen
from runtime.layers.sampler import check_finite, row_max, sample, token_logprobs, token_probabilities
from runtime.mem_cache.hicache import HostKVCache
from runtime.mem_cache.slots import KVSlots
from runtime.models.calibration import prepare_prefill_weights
from runtime.models.loader import load_model
from runtime.models.tokenizer import load_tokenizer
from runtime.scheduler.batch import ScheduledBatch
from runtime.scheduler.scheduler import Scheduler
from runtime.startup import announce
from runtime.tracing import check_endpoint, make_tracer
from runtime.tracing.reporter import TracingEventReporter
from runtime.speculative.acceptance import accept_greedy, accept_sampling
from runtime.speculative.speculator import Speculator
from telemetry.logging import EventReporter
from telemetry.ratelimit import RateLimiter
from telemetry.stats import EngineStats

log = structlog.get_logger("swa_runtime.engine")


class StepObserver(Protocol):
    """Watches the engine's steps without changing them (benchmarks, progress bars): called after each step
    has been processed, with the batch and the seconds its forward took."""

    def after_step(self, batch: ScheduledBatch, forward_seconds: float) -> None: ...


class Engine:
    def __init__(self, cfg: EngineConfig, progress: bool = True, model=None, tokenizer=None,
                 observer: StepObserver | None = None):
        """`model` (and `tokenizer`) may be given pre-built, e.g. a test's model with a chosen window. `auto`
        dtype and quantization are resolved first (`EngineConfig.concrete`): `self.cfg` says what runs."""
        self.cfg = cfg = cfg.concrete(model)
        if cfg.otlp_traces_endpoint is not None:  # before the model loads: a bad URL or a missing SDK fails fast
            check_endpoint(cfg.otlp_traces_endpoint)
        torch.manual_seed(cfg.seed)
        if model is None:
            if cfg.dtype == "bfloat16" and torch.device(cfg.device).type == "cpu":
                # first: the weights' low-bit copies are made on them (a machine's first start builds them here)
                _load_cpu_kernels(progress)
            if progress:
                announce(f"loading the weights of {cfg.model} ({cfg.dtype}, quantization {cfg.quantization})")
            _, model = load_model(cfg.model, dtype=getattr(torch, cfg.dtype), device=cfg.device, progress=progress,
                                  quantization=cfg.quantization, compile_layers=cfg.compile_decode)
        elif (getattr(model, "quantization", "none"), getattr(model, "layers_compiled", False)) != (
                cfg.quantization, cfg.compile_decode):
            raise ValueError(f"the model given does not match the config's quantization={cfg.quantization!r}, "
                             f"compile_decode={cfg.compile_decode}: build it with load_model(..., quantization=..., "
                             "compile_layers=...)")
        elif model.dtype == torch.bfloat16 and model.device.type == "cpu":
            _load_cpu_kernels(progress)
        set_head_screen(model, cfg.lm_head_screen)  # runtime/layers/head_screen.py
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model)
        prepare_prefill_weights(model, cfg.prefill_weights == "int8-128", self.tokenizer)  # runtime/models/calibration
        packed = packed_shapes(model)  # runtime/layers/linear.py
        if progress and packed:
            announce(f"oneDNN's prefill shapes: {len(packed)} weights at row counts up to {cfg.chunked_prefill_size} "
                     f"in steps of {ROW_BUCKET}")
        warm_row_counts(packed, cfg.chunked_prefill_size)
        arena = getattr(model, "decode_arena", None)  # runtime/layers/weight_arena.py
        if progress and arena is not None:
            announce(f"decode weights: {arena.nbytes / 1e6:.0f} MB in one buffer in read order, "
                     f"{arena.huge_bytes / 1e6:.0f} MB of it in 2 MB pages")
        self.model_config = model.config
        self.resolved = rc = cfg.resolve(model.config)
        self.stats = EngineStats(cfg.loc_cache, model=model_label(cfg.model), backend=cfg.attention_backend,
                                 gauges=self, dtype=cfg.dtype, quantization=cfg.quantization)
        # tracing off: no tracer, and every hook is a None check
        self.tracer = None
        if cfg.otlp_traces_endpoint is not None:
            self.tracer = make_tracer(cfg.otlp_traces_endpoint, self.stats.build_info)
        limiter = RateLimiter(interval_s=60.0)
        self.reporter = (EventReporter(self.stats, limiter) if self.tracer is None
                         else TracingEventReporter(self.stats, limiter, tracer=self.tracer))
        if progress:
            graphs = "decode and verify" if cfg.speculative_algorithm != "none" else "decode"
            announce("allocating the KV pools" + (f"; warm-up and {graphs} graph capture" if cfg.graphs else ""))
        self.runner = ModelRunner(rc, model, self.stats, self.reporter, Faults.parse(cfg.inject), progress,
                                  tracer=self.tracer)
        self.pool = self.runner.pool
        self.slots = KVSlots(self.pool.allocator, HostKVCache(self.pool, cfg.hicache_size, self.stats),
                             prefix_cache=not cfg.disable_prefix_caching, window=rc.window,
                             stats=self.stats.prefix_cache)
        speculator = None
        if cfg.speculative_algorithm != "none":
            speculator = Speculator(cfg.speculative_algorithm, cfg.num_speculative_tokens, cfg.prompt_lookup_min,
                                    cfg.prompt_lookup_max, stats=self.stats.spec)
        self.scheduler = Scheduler(rc, self.slots, self.stats, self.tokenizer.eos_token_ids, tracer=self.tracer,
                                   speculator=speculator)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.observer = observer
        self._failure_logs = RateLimiter(interval_s=60.0)  # a failing request per step must not flood the log

    @property
    def context_length(self) -> int:
        return self.resolved.context_length

    # ---- the loop body -----------------------------------------------------------------------------------
    def step(self) -> bool:
        """Schedule -> run -> process. False when there was nothing to run."""
        batch = self.scheduler.schedule()
        if batch is None:
            return False
        start = time.perf_counter()
        logits = self.runner.forward(self._forward_batch(batch))  # (B, vocab); a verify: (T, vocab)
        seconds = time.perf_counter() - start
        if batch.is_verify:
            self.scheduler.process_verify(batch, self._accept(batch, logits))
            for r in batch.reqs:  # emitted tokens past a budget or a stop token were dropped: their logits too
                if r.logits is not None:
                    del r.logits[len(r.output_ids):]
        else:
            self.scheduler.process(batch, self._sample(batch, logits))
        if self.observer is not None:
            self.observer.after_step(batch, seconds)
        return True

    def _forward_batch(self, batch: ScheduledBatch) -> ForwardBatch:
        """The tensors of a forward; the request table gets each request's new slots (whole rows if fresh)."""
        table = self.runner.req_to_token
        locs = torch.tensor(batch.out_locs, dtype=torch.int64)  # torch's allocator: its addresses get reused
        offset = 0
        for r, p, s, fresh in zip(batch.reqs, batch.prefix_lens, batch.seq_lens, batch.fresh_rows):
            if fresh and p:
                table.write(r.row, 0, int_tensor(r.locs[:p]))
            table.write(r.row, p, locs[offset:offset + s - p])
            offset += s - p
        device = self.cfg.device
        return ForwardBatch(
            is_decode=batch.is_decode,
            input_ids=int_tensor(batch.input_ids(), device=device),
            positions=int_tensor(batch.positions(), device=device),
            out_cache_loc=locs.to(device),
            req_rows=[r.row for r in batch.reqs],
            prefix_lens=list(batch.prefix_lens),
            seq_lens=list(batch.seq_lens),
            rids=tuple(r.rid for r in batch.reqs) if self.tracer is not None else (),
            verify=batch.is_verify,
        )

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[int]:
        """One token per request in `batch.sample`. A seeded request draws from its own generator; a request
        that asked for log probabilities gets them appended to `output_logprobs` before the scheduler hands
        the token on. A request whose sampling fails ends with status `error` (its token is skipped); the
        others are unaffected."""
        every = len(batch.sample) == logits.shape[0] and batch.sample == tuple(range(logits.shape[0]))
        rows = logits if every else logits[list(batch.sample)]  # a decode batch samples every row: no copy
        reqs = [batch.reqs[i] for i in batch.sample]
        for r, row in zip(reqs, rows):
            if r.logits is not None:
                r.logits.append(row.float().cpu())
        generators = [self._generator_of(r) for r in reqs]
        try:
            tokens = sample(rows, [r.params for r in reqs], generators)
        except Exception:  # noqa: BLE001 - find the request that failed; fail it alone
            tokens = []
            for r, row, gen in zip(reqs, rows, generators):
                try:
                    tokens.extend(sample(row[None], [r.params], gen))
                except Exception as exc:  # noqa: BLE001
                    if self._failure_logs.allow("sampling_failed"):
                        log.warning("sampling_failed", error=f"{type(exc).__name__}: {exc}")
                    self.scheduler.abort(r.rid, status="error", reason="error", message=f"sampling failed: {exc}")
                    tokens.append(-1)  # skipped: the request is done
        self._record_logprobs(reqs, rows, tokens)
        return tokens

    def _generator_of(self, r: Req) -> torch.Generator:
        """The request's own generator if it has a seed (made on its first sample), else the engine's."""
        if r.params.seed is None:
            return self.generator
        if r.generator is None:
            r.generator = torch.Generator().manual_seed(r.params.seed)
        return r.generator

    @staticmethod
    def _record_logprobs(reqs: list[Req], rows: torch.Tensor, tokens: list[int]) -> None:
        want = [i for i, (r, t) in enumerate(zip(reqs, tokens)) if r.params.logprobs is not None and t >= 0]
        if not want:
            return
        found = token_logprobs(rows[want], [tokens[i] for i in want], [reqs[i].params.logprobs for i in want])
        for i, (chosen, top) in zip(want, found):
            reqs[i].output_logprobs.append(TokenLogprob(chosen, tuple(top)))

    def _accept(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[list[int]]:
        """Per request of a verify batch, the tokens to emit: greedy requests keep the longest draft prefix
        the model agrees with plus its own next token (exactly what one-token steps give); sampled requests go
        through speculative sampling (the target's distribution kept). A request whose logits cannot be
        sampled ends alone with status `error` (nothing emitted)."""
        out, offset = [], 0
        for r, p, s, draft in zip(batch.reqs, batch.prefix_lens, batch.seq_lens, batch.drafts):
            rows = logits[offset:offset + s - p]  # (1 + len(draft), vocab): position p's logits first
            offset += s - p
            try:
                if r.params.temperature == 0.0:
                    check_finite(rows)
                    tokens = accept_greedy(list(draft), row_max(rows)[1].tolist())
                else:
                    tokens = accept_sampling(list(draft), token_probabilities(rows, r.params), self._generator_of(r))
            except Exception as exc:  # noqa: BLE001 - fail this request alone, as `_sample` does
                if self._failure_logs.allow("sampling_failed"):
                    log.warning("sampling_failed", error=f"{type(exc).__name__}: {exc}")
                self.scheduler.abort(r.rid, status="error", reason="error", message=f"sampling failed: {exc}")
                out.append([])
                continue
            if r.logits is not None:
                r.logits.extend(row.float().cpu() for row in rows[:len(tokens)])
            out.append(tokens)
        return out

    # ---- offline -----------------------------------------------------------------------------------------
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
                if not self.step():
                    raise RuntimeError("scheduler made no progress with requests pending")
        finally:
            for r in reqs:
                if not r.done:
                    self.scheduler.abort(r.rid)
        if logits_out is not None:
            logits_out.extend(torch.stack(r.logits) for r in reqs)
        return [r.output_ids for r in reqs]

    def close(self) -> None:
        """The engine is done serving: log what the event rate limiter still held back, export the spans."""
        self.reporter.flush()
        if self.tracer is not None:
            self.tracer.shutdown()

    # ---- gauges (read at scrape time) --------------------------------------------------------------------
    def kv_tokens(self) -> dict[tuple[str, str], int]:
        return self.slots.usage()

    def queue_sizes(self) -> tuple[int, int]:
        return self.scheduler.queue_sizes()


def model_label(model: str) -> str:
    """The model's name for labels and logs: a registry name as it is, a path reduced to its file stem
    (labels must not carry file-system paths)."""
    from pathlib import PurePath

    name = PurePath(str(model)).name
    return name.removesuffix(".gguf") or "unknown"


def _load_cpu_kernels(progress: bool) -> None:
    """Build (first start on a machine) or load the fused CPU kernels now, not inside the first request."""
    if progress:
        announce("fused CPU kernels: loading (built once per machine and CPU, 35 s to 2.5 minutes the first time)")
    if kernels.load() is None and progress:
        announce(f"fused CPU kernels unavailable, the torch path serves: {kernels.failure()}")
