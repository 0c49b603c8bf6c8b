"""Engine configuration: one frozen dataclass, validated once, derived values computed by `resolve()`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

POLICIES = ("memo", "layerwise", "per_forward", "off")
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

    def pool_sizes(self) -> tuple[int, int]:
        """(full, SWA) pool sizes in tokens, each rounded down to whole pages."""
        ps = self.page_size
        full = self.max_total_tokens // ps * ps
        swa = int(full * self.swa_full_tokens_ratio) // ps * ps
        return full, swa
