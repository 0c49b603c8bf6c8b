"""ModelRunner: owns the pools and the backend, and runs one forward.

Forward entry is where the translation cache is made safe: a new forward id is installed in the context and
the cache is invalidated *before* choosing graph replay or eager, so neither branch can see an entry from
an earlier forward (the `skip-forward-invalidation` fault moves it after the graph branch, into eager only).
"""

from __future__ import annotations

import time

import torch

from runtime.attention.base import make_backend
from runtime.config import EngineConfig
from runtime.context import ForwardContext, forward_context
from runtime.executor.forward_batch import ForwardBatch
from runtime.executor.graph_runner import StaticGraphRunner
from runtime.faults import Faults
from runtime.mem_cache.req_to_token import ReqToTokenPool
from runtime.mem_cache.swa_pool import build_hybrid_kv_pool
from telemetry.stats import EngineStats, NullTranslationStats

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class PoolTooSmallError(ValueError):
    pass


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model, stats: EngineStats, reporter, faults: Faults = Faults(),
                 progress: bool = False):
        self.cfg = cfg
        self.model = model
        self.model_config = model.config
        self.stats = stats
        self.faults = faults
        mc = self.model_config
        full, swa = cfg.pool_sizes()
        window = mc.sliding_window if mc.sliding_layer_ids else None
        if window is not None and swa < window + cfg.page_size:
            raise PoolTooSmallError(
                f"SWA pool of {swa} tokens cannot hold one sliding window ({window}) plus a page "
                f"({cfg.page_size}); raise --max-total-tokens ({cfg.max_total_tokens}) or "
                f"--swa-full-tokens-ratio ({cfg.swa_full_tokens_ratio})"
            )
        self.context_length = min(cfg.context_length or mc.max_position_embeddings, mc.max_position_embeddings)
        self.pool = build_hybrid_kv_pool(
            full_size=full, swa_size=swa, page_size=cfg.page_size,
            layer_is_swa=[mc.is_sliding(i) for i in range(mc.num_hidden_layers)],
            num_kv_heads=mc.num_key_value_heads, head_dim=mc.head_dim, dtype=DTYPES[cfg.dtype],
            policy=cfg.loc_cache, device=cfg.device,
            stats=stats.translation if cfg.telemetry else NullTranslationStats(cfg.loc_cache),
            reporter=reporter if cfg.telemetry else None,
            **self._translator_options(),
        )
        if "skip-alloc-invalidation" in faults:
            self.pool.allocator.invalidate_on_mutation = False
        if "skip-register-mapping-invalidation" in faults:
            self.pool.skip_invalidation_sites = frozenset({"register_mapping"})
        self.req_to_token = ReqToTokenPool(cfg.max_running_requests, self.context_length, cfg.device)
        self.backend = make_backend(cfg.attention_backend, self.pool, self.req_to_token, window)
        self._forward_id = 0
        self.graph_runner = StaticGraphRunner(self, cfg.graph_batch_sizes) if cfg.graphs else None
        if self.graph_runner is not None:
            self.graph_runner.capture(progress)

    def _translator_options(self) -> dict:
        if self.cfg.loc_cache not in ("memo", "layerwise"):
            return {}
        options = {"guard": self.cfg.loc_cache_guard, "verify_rate": self.cfg.loc_cache_verify}
        if self.cfg.loc_cache == "memo":
            options.update(self.faults.translator_options())
        return options

    @property
    def last_forward_id(self) -> int:
        """Id of the latest forward started (0 before the first)."""
        return self._forward_id

    def next_forward_id(self) -> int:
        self._forward_id += 1
        return self._forward_id

    @torch.no_grad()  # not inference_mode: tensors created there track no version, and the guard needs them
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (B, vocab) float32 at each request's last new token."""
        start = time.perf_counter()
        forward_id = self.next_forward_id()
        if "skip-forward-invalidation" not in self.faults:
            self.pool.invalidate_loc_cache("forward_entry")
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            mode = "graph_replay"
            logits = self.graph_runner.replay(batch, forward_id)
        else:
            if "skip-forward-invalidation" in self.faults:
                self.pool.invalidate_loc_cache("forward_entry")
            mode = "eager_decode" if batch.is_decode else "eager_extend"
            logits = self.run(batch, mode, forward_id)
        if self.cfg.telemetry:
            self.stats.record_forward(mode, time.perf_counter() - start)
        return logits

    def run(self, batch: ForwardBatch, mode: str, forward_id: int) -> torch.Tensor:
        """The model over `batch` in `mode`, inside its forward context."""
        ctx = ForwardContext(forward_id=forward_id, mode=mode, batch=batch, attn_backend=self.backend)
        with forward_context(ctx, bind_logging=self.cfg.telemetry):
            self.backend.init_forward_metadata(batch)
            hidden = self.model(batch.input_ids, batch.positions)  # (T, hidden)
            return self.model.compute_logits(hidden[batch.last_token_index()])  # (B, vocab)
