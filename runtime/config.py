"""Engine configuration: one frozen dataclass, validated once, derived values computed by `resolve()`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from telemetry.names import POLICIES

BACKENDS = ("torch", "triton")
KV_SANITIZER_MODES = ("off", "sampled", "strict")  # docs/kv-sanitizer.md
DTYPES = ("auto", "float32", "bfloat16")  # auto: runtime/auto_settings.py
QUANTIZATIONS = ("auto", "none", "int8", "int8-head")  # weight formats (runtime/layers/quantized.py, decode_linear.py)
PREFILL_WEIGHTS = ("int8-128", "gguf")  # the rows past eight on int8-head's kernels (runtime/layers/decode_linear.py)
SPECULATIVE_ALGORITHMS = ("none", "ngram", "suffix")  # draft-free speculative decoding (runtime/speculative/)


@dataclass(frozen=True)
class EngineConfig:
    model: str = "gemma3-270m"
    # auto: the fastest setting measured on this kind of CPU (runtime/auto_settings.py), made concrete by
    # `concrete()` before anything is built; token-exact comparisons pin float32 / none.
    dtype: str = "auto"
    quantization: str = "auto"  # int8: weight-only int8 projections and LM head; int8-head: see decode_linear.py
    auto_reason: str | None = None  # what `auto` followed from, once `concrete()` resolved it (None: as given)
    # int8-head on our kernels: a batch-1 step reads a coarse int4 copy of the head and refines its top in 8 bits
    # (runtime/layers/head_screen.py); off: the int8 head alone
    lm_head_screen: bool = True
    # int8-head on our kernels, rows past eight (prefill, decode batches past eight): int8-128, int8 weights and
    # activations in blocks of 128 (requantised from the GGUF's at load and smoothed by a calibration run at
    # start-up, 1.2x prefill's projections; runtime/models/calibration.py); gguf: the GGUF's own blocks for every
    # row count
    prefill_weights: str = "int8-128"
    compile_decode: bool = False  # torch.compile each layer's math around the (eager) attention call
    device: str = "cpu"
    attention_backend: str = "torch"
    loc_cache: str = "memo"
    loc_cache_guard: bool = True
    loc_cache_verify: float = 0.0
    kv_sanitizer: str = "sampled"  # KV ownership checks: off, sampled (cheap, default) or strict (every access)
    graphs: bool = True  # graph replay for decode and verify (CUDA graphs on GPU, static-buffer replay on CPU)
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    page_size: int = 1
    # KV pools: by default sized from a memory budget (GiB of K+V), the SWA pool for the concurrency it must
    # serve; `max_total_tokens` (and `swa_full_tokens_ratio`) size them by hand instead.
    kv_cache_memory: float = 1.0
    max_total_tokens: int | None = None  # full pool in tokens
    swa_full_tokens_ratio: float | None = None  # SWA pool size / full pool size (with max_total_tokens)
    max_running_requests: int = 16
    context_length: int | None = None  # None: the model's
    chunked_prefill_size: int = 2048
    hicache_size: int = 0  # host-memory KV tier in tokens (0: retracted requests are recomputed)
    disable_prefix_caching: bool = False  # the radix cache of finished requests' KV (docs/prefix-cache.md)
    # Speculative decoding: drafts of up to `num_speculative_tokens` tokens from the request's own tokens
    # (ngram: prompt lookup of the last prompt_lookup_max..min tokens) or from a suffix table that also learns
    # earlier outputs (suffix), scored by one verify forward per step.
    speculative_algorithm: str = "none"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    telemetry: bool = True
    otlp_traces_endpoint: str | None = None  # OpenTelemetry traces to this OTLP/HTTP collector (docs/tracing.md)
    seed: int = 0
    inject: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.loc_cache not in POLICIES:
            raise ValueError(f"--loc-cache must be one of {', '.join(POLICIES)}, got {self.loc_cache!r}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"--attention-backend must be one of {', '.join(BACKENDS)}, got {self.attention_backend!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.prefill_weights not in PREFILL_WEIGHTS:
            raise ValueError(f"--prefill-weights must be one of {', '.join(PREFILL_WEIGHTS)}, "
                             f"got {self.prefill_weights!r}")
        if self.kv_sanitizer not in KV_SANITIZER_MODES:
            raise ValueError(f"--kv-sanitizer must be one of {', '.join(KV_SANITIZER_MODES)}, "
                             f"got {self.kv_sanitizer!r}")
        if not 0.0 <= self.loc_cache_verify <= 1.0:
            raise ValueError(f"--loc-cache-verify must be within [0, 1], got {self.loc_cache_verify}")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"--max-total-tokens must be at least one page ({self.page_size})")
        if self.swa_full_tokens_ratio is not None and not 0.0 < self.swa_full_tokens_ratio <= 1.0:
            raise ValueError(f"--swa-full-tokens-ratio must be within (0, 1], got {self.swa_full_tokens_ratio}")
        if not self.kv_cache_memory > 0:
            raise ValueError(f"--kv-cache-memory must be a positive number of GiB, got {self.kv_cache_memory}")
        if self.hicache_size < 0:
            raise ValueError(f"--hicache-size must be >= 0, got {self.hicache_size}")
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"--speculative-algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}, "
                             f"got {self.speculative_algorithm!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"--num-speculative-tokens must be within 1..16, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"--prompt-lookup-min/max need 1 <= min <= max, got {self.prompt_lookup_min}, "
                             f"{self.prompt_lookup_max}")
        if self.chunked_prefill_size < 1 or self.max_running_requests < 1:
            raise ValueError("--chunked-prefill-size and --max-running-requests must be positive")

    def with_(self, **changes) -> "EngineConfig":
        return replace(self, **changes)

    def concrete(self, model=None) -> "EngineConfig":
        """This config with `auto` dtype and quantization replaced by what they resolve to on this CPU (or, for
        a model built beforehand, by what that model is); unchanged when neither is `auto`."""
        from runtime.auto_settings import resolve_auto
        from runtime.models.registry import TINY_MODEL

        dtype, quantization, reason = resolve_auto(self.dtype, self.quantization, tiny=self.model == TINY_MODEL,
                                                   model=model)
        if reason is None:
            return self
        return replace(self, dtype=dtype, quantization=quantization, auto_reason=reason)

    def resolve(self, model_config) -> "ResolvedConfig":
        """The values derived from this config and the model's, computed once (raises PoolTooSmallError);
        `auto` settings resolved first (`concrete`), so `ResolvedConfig.engine` names what runs."""
        if "auto" in (self.dtype, self.quantization):
            return self.concrete().resolve(model_config)
        ps = self.page_size
        window = model_config.sliding_window if model_config.sliding_layer_ids else None
        limit = model_config.max_position_embeddings
        context = min(self.context_length or limit, limit)
        if self.max_total_tokens is not None:
            full = self.max_total_tokens // ps * ps
            swa = int(full * (self.swa_full_tokens_ratio or 0.25)) // ps * ps
        else:
            full, swa = self._budget_pools(model_config, window, context)
        if window is not None and swa < window + ps:
            raise PoolTooSmallError(
                f"SWA pool of {swa} tokens cannot hold one sliding window ({window}) plus a page ({ps}); "
                f"raise --max-total-tokens ({self.max_total_tokens}) or --swa-full-tokens-ratio "
                f"({self.swa_full_tokens_ratio})"
            )
        return ResolvedConfig(engine=self, full_pool_size=full, swa_pool_size=swa, window=window,
                              context_length=context, vocab_size=model_config.vocab_size)


    def _budget_pools(self, model_config, window: int | None, context: int) -> tuple[int, int]:
        """(full, SWA) pool sizes from `kv_cache_memory`. The SWA pool holds what `max_running_requests`
        requests can need at once (a window and a page each, plus one prefill chunk), so a full batch never
        thrashes on it; the full pool takes the rest of the budget, but no more than every running request's
        whole context (more would never be used)."""
        ps, element = self.page_size, 2 if self.dtype == "bfloat16" else 4
        per_layer = 2 * model_config.num_key_value_heads * model_config.head_dim * element  # K and V
        full_bytes = per_layer * len(model_config.full_layer_ids)
        swa_bytes = per_layer * len(model_config.sliding_layer_ids)
        budget = int(self.kv_cache_memory * 2**30)
        ceiling = -(-(self.max_running_requests * context + self.chunked_prefill_size) // ps) * ps
        swa = 0
        if window is not None:
            swa = self.max_running_requests * (window + ps) + self.chunked_prefill_size
            swa = min(-(-swa // ps) * ps, ceiling)
        full = (budget - swa * swa_bytes) // max(full_bytes, 1) // ps * ps
        full = min(full, ceiling)
        if full < max(swa, ps):
            raise PoolTooSmallError(
                f"--kv-cache-memory {self.kv_cache_memory:g} GiB holds the SWA pool for {self.max_running_requests} "
                f"requests ({swa} tokens, {swa * swa_bytes / 2**20:.0f} MiB) but leaves no room for the full pool: "
                "raise --kv-cache-memory or lower --max-running-requests")
        return full, swa


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
