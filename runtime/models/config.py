"""The Gemma 3 text model's configuration: a frozen record of shapes and hyper-parameters.

Built once (from a GGUF file's metadata, a Hugging Face `config.json`, or `Gemma3Config.tiny()`) and never
mutated; values that follow from others are properties, not stored copies.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping

SLIDING = "sliding_attention"
FULL = "full_attention"

# Gemma 3 interleaves five sliding-window layers with one global layer; Hugging Face configs that predate
# `layer_types` carry this as `sliding_window_pattern`, and GGUF files carry nothing (llama.cpp hard-codes it).
DEFAULT_SLIDING_WINDOW_PATTERN = 6
DEFAULT_ROPE_THETA = 1_000_000.0  # global (full-attention) layers
DEFAULT_ROPE_LOCAL_BASE_FREQ = 10_000.0  # sliding-window layers


def pattern_layer_types(num_layers: int, pattern: int = DEFAULT_SLIDING_WINDOW_PATTERN) -> tuple[str, ...]:
    """Layer `i` is global when `(i + 1) % pattern == 0`, sliding otherwise (Gemma 3's interleaving)."""
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


@dataclass(frozen=True)
class RopeScaling:
    """Position scaling of the global layers' RoPE (Gemma 3 4B+ use `linear` with factor 8)."""

    rope_type: str
    factor: float

    def __post_init__(self) -> None:
        if self.rope_type != "linear":
            raise NotImplementedError(f"rope scaling {self.rope_type!r} is not supported (only 'linear')")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}")


@dataclass(frozen=True)
class Gemma3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    sliding_window: int
    layer_types: tuple[str, ...]
    query_pre_attn_scalar: float
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_local_base_freq: float = DEFAULT_ROPE_LOCAL_BASE_FREQ
    rope_scaling: RopeScaling | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    bos_token_id: int = 2
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        unknown = set(self.layer_types) - {SLIDING, FULL}
        if unknown:
            raise ValueError(f"unknown layer types {sorted(unknown)}; expected {SLIDING!r} or {FULL!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{self.num_attention_heads} query heads do not group evenly over "
                f"{self.num_key_value_heads} key/value heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise NotImplementedError(f"activation {self.hidden_activation!r} is not supported")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    # ---- derived values -------------------------------------------------------------------------------

    def is_sliding(self, layer_id: int) -> bool:
        return self.layer_types[layer_id] == SLIDING

    def layer_window(self, layer_id: int) -> int | None:
        """Tokens a query at position p sees on this layer: positions p-window+1 .. p; None = all."""
        return self.sliding_window if self.is_sliding(layer_id) else None

    def rope_base(self, layer_id: int) -> float:
        return self.rope_local_base_freq if self.is_sliding(layer_id) else self.rope_theta

    def rope_factor(self, layer_id: int) -> float:
        """Linear position scaling applies to the global layers only (as in Gemma 3 4B+)."""
        if self.rope_scaling is None or self.is_sliding(layer_id):
            return 1.0
        return self.rope_scaling.factor

    @property
    def attn_scaling(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5

    @property
    def sliding_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_sliding(i))

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_sliding(i))

    def with_(self, **changes: Any) -> Gemma3Config:
        """A new config with `changes` applied (validated again); this one is left untouched."""
        return replace(self, **changes)

    # ---- Hugging Face interop -------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> Gemma3Config:
        """From a Hugging Face `config.json` dict (`gemma3_text`, or `gemma3` with a `text_config`).

        Understands both rope layouts: the v5 `rope_parameters` keyed by layer type, and the older
        `rope_theta` / `rope_local_base_freq` / `rope_scaling` fields.
        """
        if "text_config" in d and d.get("model_type") == "gemma3":
            d = d["text_config"]
        model_type = d.get("model_type", "gemma3_text")
        if model_type != "gemma3_text":
            raise ValueError(f"not a Gemma 3 text config (model_type={model_type!r})")

        num_layers = int(d["num_hidden_layers"])
        layer_types = d.get("layer_types")
        if layer_types is None:
            pattern = int(d.get("sliding_window_pattern", DEFAULT_SLIDING_WINDOW_PATTERN))
            layer_types = pattern_layer_types(num_layers, pattern)

        rope_theta, local_theta, scaling = _rope_from_hf(d)
        eos = d.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        head_dim = int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"])
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d["num_key_value_heads"]),
            head_dim=head_dim,
            sliding_window=int(d["sliding_window"]),
            layer_types=tuple(layer_types),
            query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256),
            max_position_embeddings=int(d["max_position_embeddings"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_local_base_freq=local_theta,
            rope_scaling=scaling,
            hidden_activation=d.get("hidden_activation", "gelu_pytorch_tanh"),
            final_logit_softcapping=d.get("final_logit_softcapping"),
            attn_logit_softcapping=d.get("attn_logit_softcapping"),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            bos_token_id=int(d.get("bos_token_id", 2)),
            eos_token_ids=eos_ids,
            pad_token_id=int(d.get("pad_token_id", 0)),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A dict that `transformers.Gemma3TextConfig(**d)` accepts (v5 `rope_parameters` layout)."""
        full_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            full_rope.update(rope_type=self.rope_scaling.rope_type, factor=self.rope_scaling.factor)
        return {
            "model_type": "gemma3_text",
            "architectures": ["Gemma3ForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types),
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {
                FULL: full_rope,
                SLIDING: {"rope_type": "default", "rope_theta": self.rope_local_base_freq},
            },
            "hidden_activation": self.hidden_activation,
            "final_logit_softcapping": self.final_logit_softcapping,
            "attn_logit_softcapping": self.attn_logit_softcapping,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0],
            "pad_token_id": self.pad_token_id,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ---- test model ----------------------------------------------------------------------------------

    @classmethod
    def tiny(
        cls,
        *,
        num_hidden_layers: int = 6,
        sliding_window_pattern: int = 3,
        sliding_window: int = 8,
        vocab_size: int = 260,
        max_position_embeddings: int = 1024,
    ) -> Gemma3Config:
        """A Gemma 3-shaped model small enough for unit tests (6 layers: S S F S S F, window 8).

        The pattern is denser than the real 5:1 so that a handful of layers still holds two global
        layers, each preceded by sliding ones. The vocabulary fits the byte tokenizer (4 specials + 256).
        """
        return cls(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=sliding_window,
            layer_types=pattern_layer_types(num_hidden_layers, sliding_window_pattern),
            query_pre_attn_scalar=16,
            max_position_embeddings=max_position_embeddings,
            rms_norm_eps=1e-6,
        )


def _rope_from_hf(d: Mapping[str, Any]) -> tuple[float, float, RopeScaling | None]:
    params = d.get("rope_parameters")
    if params and (FULL in params or SLIDING in params):
        full = params.get(FULL) or {}
        local = params.get(SLIDING) or {}
        rope_theta = float(full.get("rope_theta", DEFAULT_ROPE_THETA))
        local_theta = float(local.get("rope_theta", DEFAULT_ROPE_LOCAL_BASE_FREQ))
        if local.get("rope_type", "default") != "default":
            raise NotImplementedError("scaled RoPE on sliding layers is not supported")
        scaling_dict = full if full.get("rope_type", "default") != "default" else None
    else:
        rope_theta = float(d.get("rope_theta", DEFAULT_ROPE_THETA))
        local_theta = float(d.get("rope_local_base_freq", DEFAULT_ROPE_LOCAL_BASE_FREQ))
        scaling_dict = d.get("rope_scaling") or None
    scaling = None
    if scaling_dict is not None:
        rope_type = scaling_dict.get("rope_type", scaling_dict.get("type"))
        if rope_type != "default":
            scaling = RopeScaling(rope_type=rope_type, factor=float(scaling_dict["factor"]))
    return rope_theta, local_theta, scaling
