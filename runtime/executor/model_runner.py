"""ModelRunner: owns the pools, the request table and the backend, and runs one forward.

Forward entry is where the translation cache is made safe: the runner picks the branch (a replay over
static buffers or eager), takes a new forward id and tells the pool (`begin_forward`), which invalidates the
cache *before* either branch runs, so neither can see an entry from an earlier forward (the
`skip-forward-invalidation` fault keeps the invalidation on the eager branches only). Graph warm-up and
capture runs, decode and verify alike, are forwards of their own and invalidate the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from tqdm import tqdm

from runtime.attention.registry import make_backend
from runtime.config import ResolvedConfig
from runtime.context import ForwardContext, forward_context
from runtime.executor.forward_batch import ForwardBatch
from runtime.executor.graph_runner import WARMUP_RUNS, StaticGraphRunner, StaticVerifyRunner
from runtime.faults import Faults
from runtime.mem_cache.req_to_token import ReqToTokenPool
from runtime.mem_cache.swa_pool import build_hybrid_kv_pool
from telemetry.stats import EngineStats, NullTranslationStats

# Every way a forward can run. Each branch below counts itself in `branch_counts`, and `swa-runtime diagnose`
# fails unless its workload ran every one, so a new branch must be declared here and cannot go unexercised.
BRANCHES = (
    "eager_extend",  # a prefill chunk
    "eager_decode",  # decode without a graph: graphs off, or a batch larger than the largest graph size
    "graph_replay",  # decode over the static buffers of a captured batch size
    "graph_capture",  # warm-up and capture runs at start-up
    "multi_step",  # several decode steps inside one forward
    # a speculative step (mode target_verify): each request's last token and its draft, scored in one forward
    "eager_verify",  # without static buffers: graphs off, or more requests than the largest verify size
    "verify_replay",  # over the static buffers of a captured (batch size, K)
)
REPLAYS = ("graph_replay", "verify_replay")  # the branches that run over static buffers


class ModelRunner:
    def __init__(self, rc: ResolvedConfig, model, stats: EngineStats, reporter, faults: Faults = Faults(),
                 progress: bool = False, tracer=None):
        """`tracer`: an EngineTracer that gets a span per forward (None: tracing off)."""
        cfg = rc.engine
        self.tracer = tracer
        self.cfg = cfg
        self.model = model
        self.model_config = mc = model.config
        self.stats = stats
        self.context_length = rc.context_length
        self.pool = build_hybrid_kv_pool(
            full_size=rc.full_pool_size, swa_size=rc.swa_pool_size, page_size=cfg.page_size,
            layer_is_swa=[mc.is_sliding(i) for i in range(mc.num_hidden_layers)],
            num_kv_heads=mc.num_key_value_heads, head_dim=mc.head_dim, dtype=getattr(torch, cfg.dtype),
            policy=cfg.loc_cache, device=cfg.device,
            stats=stats.translation if cfg.telemetry else NullTranslationStats(cfg.loc_cache),
            reporter=reporter if cfg.telemetry else None, faults=faults, kv_sanitizer=cfg.kv_sanitizer,
            **self._translator_options(faults),
        )
        self.req_to_token = ReqToTokenPool(cfg.max_running_requests, rc.context_length, cfg.device)
        self.backend = make_backend(cfg.attention_backend, self.pool, self.req_to_token, rc.window)
        self._forward_id = 0
        self.branch_counts = dict.fromkeys(BRANCHES, 0)
        self.graphs = self.verify_graphs = None
        if cfg.graphs:
            self.graphs = StaticGraphRunner(cfg.graph_batch_sizes, cfg.max_running_requests, cfg.device)
            if cfg.speculative_algorithm != "none":
                self.verify_graphs = StaticVerifyRunner(cfg.graph_batch_sizes, cfg.max_running_requests,
                                                        cfg.num_speculative_tokens, cfg.device)
            self._capture(progress)

    def _translator_options(self, faults: Faults) -> dict:
        if self.cfg.loc_cache not in ("memo", "layerwise"):
            return {}
        options = {"guard": self.cfg.loc_cache_guard, "verify_rate": self.cfg.loc_cache_verify}
        if self.cfg.loc_cache == "memo":
            options.update(faults.translator_options())
        return options

    @property
    def last_forward_id(self) -> int:
        """Id of the latest forward started (0 before the first)."""
        return self._forward_id

    # ---- forwards ----------------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (B, vocab) float32 at each request's last new token; (T, vocab) at every token of a verify."""
        if batch.verify:
            replay = self.verify_graphs is not None and self.verify_graphs.can_run(batch)
            return self._forward(batch, "target_verify", "verify_replay" if replay else "eager_verify")
        if self.graphs is not None and self.graphs.can_run(batch):
            return self._forward(batch, "graph_replay")
        return self._forward(batch, "eager_decode" if batch.is_decode else "eager_extend")

    @contextmanager
    def multi_step(self) -> Iterator[Callable[[ForwardBatch], torch.Tensor]]:
        """Several eager decode steps inside one forward (one id, one entry invalidation), as a multi-step or
        draft decoder runs them: `with runner.multi_step() as step: logits = step(batch)`."""
        self.branch_counts["multi_step"] += 1
        with self._forward_scope("eager_decode", record=False) as forward_id:
            yield lambda batch: self._run(batch, "eager_decode", forward_id)

    def _forward(self, batch: ForwardBatch, mode: str, branch: str | None = None, record: bool = True) -> torch.Tensor:
        """One forward in `mode` (the metrics' label) down `branch` (default: the mode's own)."""
        branch = branch or mode
        self.branch_counts[branch] += 1
        with self._forward_scope(mode, record, batch, replay=branch in REPLAYS) as forward_id:
            if branch in REPLAYS:
                static = self.graphs if branch == "graph_replay" else self.verify_graphs
                batch = static.load(batch)  # into the static buffers: stable addresses, padding to the sink
            return self._run(batch, mode, forward_id)  # logits of the live requests only (`ForwardBatch.live`)

    @contextmanager
    def _forward_scope(self, mode: str, record: bool = True, batch: ForwardBatch | None = None,
                       replay: bool = False) -> Iterator[int]:
        """One forward: a new id, the pool told (which invalidates), the time recorded if it completes; with
        tracing, a span linked to the requests of `batch` (a multi-step scope names none). `replay`: the
        forward runs over static buffers (what the `skip-forward-invalidation` fault looks at)."""
        start = time.perf_counter()
        self._forward_id += 1
        if self.tracer is not None:
            self.tracer.begin_forward(self._forward_id, mode, batch)
        self.pool.begin_forward(self._forward_id, mode, replay)
        try:
            with torch.no_grad():  # not inference_mode: tensors created there track no version (the guard)
                yield self._forward_id
        except BaseException as exc:
            if self.tracer is not None:
                self.tracer.fail_forward(exc)
            raise
        finally:
            self.pool.end_forward()
            if self.tracer is not None:
                self.tracer.end_forward()
        if record and self.cfg.telemetry:
            self.stats.record_forward(mode, time.perf_counter() - start)

    def _run(self, batch: ForwardBatch, mode: str, forward_id: int) -> torch.Tensor:
        """The model over `batch`, inside its forward context (the layers find the backend there)."""
        ctx = ForwardContext(forward_id=forward_id, mode=mode, batch=batch, attn_backend=self.backend)
        with forward_context(ctx, bind_logging=self.cfg.telemetry):
            self.backend.init_forward_metadata(batch)
            hidden = self.model(batch.input_ids, batch.positions)  # (T, hidden)
            rows = batch.logit_index()
            return self.model.compute_logits(hidden if rows is None else hidden[rows])  # (B or T, vocab)

    def _capture(self, progress: bool) -> None:
        """Warm up and capture every decode batch size, and every verify (batch size, K) when speculating,
        over the padding sink (each run a forward)."""
        for static, what in ((self.graphs, "decode graphs"), (self.verify_graphs, "verify graphs")):
            if static is None:
                continue
            for bs in tqdm(static.batch_sizes, desc=f"Capturing {what}", unit="batch size", disable=not progress):
                for _ in range(WARMUP_RUNS + 1):
                    self._forward(static.capture_batch(bs), "graph_capture", record=False)
