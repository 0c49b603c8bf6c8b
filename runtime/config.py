"""Engine configuration: one frozen dataclass, validated once, derived values computed by `resolve()`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from telemetry.names import POLICIES

BACKENDS = ("torch", "triton")
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "gemma3-270m"
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "torch"
    loc_cache: str = "memo"
    loc_cache_guard: bool = True
    loc_cache_verify: float = 0.0
    graphs: bool = True  # graph replay for decode (CUDA graphs on GPU, static-buffer replay on CPU)
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    page_size: int = 1
    max_total_tokens: int = 16384  # full pool
    swa_full_tokens_ratio: float = 0.25  # SWA pool size / full pool size
    max_running_requests: int = 16
    context_length: int | None = None  # None: the model's
    chunked_prefill_size: int = 2048
    hicache_size: int = 0  # host-memory KV tier in tokens (0: retracted requests are recomputed)
    disable_prefix_caching: bool = False  # the radix cache of finished requests' KV (README: Prefix cache)
    telemetry: bool = True
    seed: int = 0
    inject: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.loc_cache not in POLICIES:
            raise ValueError(f"--loc-cache must be one of {', '.join(POLICIES)}, got {self.loc_cache!r}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"--attention-backend must be one of {', '.join(BACKENDS)}, got {self.attention_backend!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not 0.0 <= self.loc_cache_verify <= 1.0:
            raise ValueError(f"--loc-cache-verify must be within [0, 1], got {self.loc_cache_verify}")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.max_total_tokens < self.page_size:
            raise ValueError(f"--max-total-tokens must be at least one page ({self.page_size})")
        if not 0.0 < self.swa_full_tokens_ratio <= 1.0:
            raise ValueError(f"--swa-full-tokens-ratio must be within (0, 1], got {self.swa_full_tokens_ratio}")
        if self.hicache_size < 0:
            raise ValueError(f"--hicache-size must be >= 0, got {self.hicache_size}")
        if self.chunked_prefill_size < 1 or self.max_running_requests < 1:
            raise ValueError("--chunked-prefill-size and --max-running-requests must be positive")

    def with_(self, **changes) -> "EngineConfig":
        return replace(self, **changes)

    def resolve(self, model_config) -> "ResolvedConfig":
        """The values derived from this config and the model's, computed once (raises PoolTooSmallError)."""
        ps = self.page_size
        full = self.max_total_tokens // ps * ps
        swa = int(full * self.swa_full_tokens_ratio) // ps * ps
        window = model_config.sliding_window if model_config.sliding_layer_ids else None
        if window is not None and swa < window + ps:
            raise PoolTooSmallError(
                f"SWA pool of {swa} tokens cannot hold one sliding window ({window}) plus a page ({ps}); "
                f"raise --max-total-tokens ({self.max_total_tokens}) or --swa-full-tokens-ratio "
                f"({self.swa_full_tokens_ratio})"
            )
        limit = model_config.max_position_embeddings
        context = min(self.context_length or limit, limit)
        return ResolvedConfig(engine=self, full_pool_size=full, swa_pool_size=swa, window=window,
                              context_length=context, vocab_size=model_config.vocab_size)


class PoolTooSmallError(ValueError):
    """The configured pools cannot serve even one request of this model."""


@dataclass(frozen=True)
class ResolvedConfig:
    """An `EngineConfig` with what follows from the model: pool sizes in whole pages, the sliding window
    (None for a model without sliding layers), the context length actually accepted."""

    engine: EngineConfig
    full_pool_size: int
    swa_pool_size: int
    window: int | None
    context_length: int
    vocab_size: int
