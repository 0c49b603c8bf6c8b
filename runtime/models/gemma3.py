"""Gemma 3 text model over the flattened tokens of a batch.

`model(input_ids (T,), positions (T,)) -> hidden (T, hidden)`; `model.compute_logits(hidden) -> (T, vocab)`
in float32. Attention itself is delegated to the backend of the forward context (see
`runtime/layers/attention.py`), so the model never sees requests, masks or KV caches.

Parameter names follow Hugging Face's `Gemma3ForCausalLM` (`model.layers.N.self_attn.q_proj.weight`, ...)
when loading, and norm weights use its zero-centred `1 + w` parameterisation. Inside, q/k/v are one
projection (`qkv_proj`) and gate/up another (`gate_up_proj`): fewer, larger matmuls per layer; a load hook
concatenates the separate checkpoint entries.

Per-layer work is kept to few operations, because decode runs every layer at batch sizes where each
operation's fixed cost is comparable to its arithmetic: the RoPE angles are looked up once per forward,
the q and k heads are normalised and rotated together, and with `compile_layers()` the math around the
attention call runs as compiled kernels (the attention call, and with it the KV pool's location
translation, stays outside the compiled regions).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from runtime import kernels
from runtime.layers.activation import gelu_and_mul
from runtime.layers.attention import Attention
from runtime.layers.decode_linear import DecodeLinear
from runtime.layers.linear import Embedding, Linear
from runtime.layers.module_call import call
from runtime.layers.norm import RMSNorm, rms_norm_scaled
from runtime.layers.quantized import Int8Embedding, Int8HeadEmbedding, Int8HeadLinear, Int8Linear
from runtime.layers.rotary import RotaryEmbedding, apply_rotary
from runtime.models.config import Gemma3Config
from runtime.models.fused_decode import FusedPlan, FusedStack, fused_forward, plan_for, stack_for, stack_forward


class WeightFormat(NamedTuple):
    linear: type[nn.Module]  # every projection
    embedding: type[nn.Module]  # the token table, also the LM head when tied
    head: type[nn.Module]  # an untied LM head


# Weight formats: quantization name -> the layers that hold the weights.
WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "none": WeightFormat(Linear, Embedding, Linear),
    "int8": WeightFormat(Int8Linear, Int8Embedding, Int8Linear),
    "int8-head": WeightFormat(DecodeLinear, Int8HeadEmbedding, Int8HeadLinear),
}


def _merge_on_load(merged: str, parts: tuple[str, ...]):
    """A load_state_dict pre-hook: checkpoint entries `parts` (e.g. q/k/v_proj) -> one `merged` weight,
    concatenated along the output dimension, in order."""

    def hook(module, state_dict, prefix, *args) -> None:
        names = [f"{prefix}{p}.weight" for p in parts]
        if all(n in state_dict for n in names):
            state_dict[f"{prefix}{merged}.weight"] = torch.cat([state_dict.pop(n) for n in names])

    return hook


class Gemma3MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, linear: type[nn.Module] = Linear) -> None:
        super().__init__()
        self.gate_up_proj = linear(hidden_size, 2 * intermediate_size)
        self.down_proj = linear(intermediate_size, hidden_size)
        self.register_load_state_dict_pre_hook(_merge_on_load("gate_up_proj", ("gate_proj", "up_proj")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, hidden)
        return self.down_proj(gelu_and_mul(self.gate_up_proj(x)))  # gate_up (T, 2I): gate | up


class Gemma3Attention(nn.Module):
    """Projections, per-head q/k RMSNorm and RoPE around the backend-agnostic `Attention`."""

    def __init__(self, config: Gemma3Config, layer_id: int, rotary: RotaryEmbedding,
                 linear: type[nn.Module] = Linear) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.qkv_proj = linear(hidden, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim)
        self.o_proj = linear(self.num_heads * self.head_dim, hidden)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.register_load_state_dict_pre_hook(_merge_on_load("qkv_proj", ("q_proj", "k_proj", "v_proj")))
        # NOTE: shared with other layers of the same kind; kept out of the module tree (a plain attribute
        # in a tuple) so it is neither listed once per layer nor part of the state dict.
        self._rotary = (rotary,)
        self._qk_scale_of: tuple | None = None  # (q scale, k scale, the two stacked per head)
        self.attn = Attention(
            layer_id=layer_id,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            scaling=config.attn_scaling,
            sliding_window=config.layer_window(layer_id),
            logit_softcapping=config.attn_logit_softcapping,
        )

    @property
    def rotary(self) -> RotaryEmbedding:
        return self._rotary[0]

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q (T, H, D), k (T, Hkv, D) normed and rotated, and v (T, Hkv, D), from x (T, hidden)."""
        T, H, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # (T, (H + 2 Hkv) D)
        fused = kernels.for_tensor(qkv)
        if fused is not None:  # norm and rotation in one pass (`runtime.kernels`)
            qk = fused.qk_norm_rope(qkv, H + Hkv, self._qk_scale(), cos, sin, self.q_norm.eps)
        else:
            qk = qkv[:, :(H + Hkv) * D].view(T, H + Hkv, D)  # q heads, then k heads
            # One norm and one rotation for all q and k heads; each head keeps its own norm weight.
            qk = apply_rotary(rms_norm_scaled(qk, self._qk_scale(), self.q_norm.eps), cos, sin)  # (T, H+Hkv, D)
        v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
        return qk[:, :H], qk[:, H:], v

    def _qk_scale(self) -> torch.Tensor:
        """The q heads' and k heads' `1 + w` stacked (H + Hkv, D), float32; rebuilt when either norm's is."""
        q, k = self.q_norm.scale(), self.k_norm.scale()
        cached = self._qk_scale_of
        if cached is not None and cached[0] is q and cached[1] is k:
            return cached[2]
        stacked = torch.cat((q.expand(self.num_heads, -1), k.expand(self.num_kv_heads, -1)))
        if not torch.compiler.is_compiling():
            self._qk_scale_of = (q, k, stacked)
        return stacked

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # (T, hidden)
        return self.o_proj(self.attn(*self.project(x, cos, sin)))  # (T, H*D) -> (T, hidden)


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms: each sub-block's input and output are normalised before the residual add.

    The layer is two pieces of math around the attention call: `_pre` (norm, projections, q/k norm,
    rotation) and `_post` (output projection, residual, MLP). `compile_math()` compiles exactly those; the
    attention call between them, which writes the KV pool through its location translation, stays eager. At
    decode sizes, with the fused CPU kernels, each piece is one call (`runtime/models/fused_decode.py`).
    """

    def __init__(self, config: Gemma3Config, layer_id: int, rotary: RotaryEmbedding,
                 linear: type[nn.Module] = Linear) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_id, rotary, linear)
        self.mlp = Gemma3MLP(hidden, config.intermediate_size, linear)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self._pre, self._post = self._pre_attention, self._post_attention
        self._fused_plan: FusedPlan | None = None  # `runtime/models/fused_decode.py`

    def _pre_attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return self.self_attn.project(self.input_layernorm(h), cos, sin)  # q, k, v

    def _post_attention(self, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:  # (T, hidden), (T, H*D)
        h = self.post_attention_layernorm(self.self_attn.o_proj(attn_out), residual=h)  # h + norm(o)
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)), residual=h)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # (T, hidden)
        plan = plan_for(self, h)
        if plan is not None:  # decode's few rows: the math on each side of attention in one call each
            return fused_forward(self, plan, h, cos, sin)
        q, k, v = self._pre(h, cos, sin)
        return self._post(h, self.self_attn.attn(q, k, v))  # (T, hidden)

    def compile_math(self) -> None:
        """Run `_pre` and `_post` through `torch.compile` (shapes dynamic in the token count)."""
        self._pre = torch.compile(self._pre_attention, dynamic=True)
        self._post = torch.compile(self._post_attention, dynamic=True)


class Gemma3Model(nn.Module):
    def __init__(self, config: Gemma3Config, quantization: str = "none") -> None:
        super().__init__()
        self.config = config
        linear, embedding, _ = WEIGHT_FORMATS[quantization]
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        # Gemma multiplies embeddings by sqrt(hidden) rounded to the model dtype (25.25, not 25.298, in
        # bfloat16 for hidden 640), as the original implementation does.
        self.register_buffer(
            "embed_scale", torch.tensor(config.hidden_size**0.5, dtype=torch.float32), persistent=False
        )
        # One table per distinct RoPE; (base, factor) -> module, shared by the layers that use it.
        ropes: dict[tuple[float, float], RotaryEmbedding] = {}
        for i in range(config.num_hidden_layers):
            key = (config.rope_base(i), config.rope_factor(i))
            if key not in ropes:
                ropes[key] = RotaryEmbedding(config.head_dim, key[0], config.max_position_embeddings, key[1])
        self.rotary = nn.ModuleList(ropes.values())
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, ropes[(config.rope_base(i), config.rope_factor(i))], linear)
            for i in range(config.num_hidden_layers)
        )
        # layer i rotates with self.rotary[self.layer_rope[i]]
        self.layer_rope = [list(ropes.values()).index(layer.self_attn.rotary) for layer in self.layers]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._fused_stack: FusedStack | None = None  # `runtime/models/fused_decode.py`

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # (T,), (T,)
        stack = stack_for(self, input_ids)
        if stack is not None:  # decode's few rows: all of it in one call (`runtime/models/fused_decode.py`)
            tables = [rotary.wide(positions) for rotary in self.rotary]
            if None not in tables:
                return stack_forward(stack, input_ids, positions, tables)
        h = self.embed_tokens(input_ids)  # (T, hidden)
        h = h * self.embed_scale.to(h.dtype)
        angles = [rotary.cos_sin(positions) for rotary in self.rotary]  # per table: cos, sin (T, 1, D)
        for layer, r in zip(self.layers, self.layer_rope):
            h = call(layer, h, *angles[r])
        return self.norm(h)  # (T, hidden)


class Gemma3ForCausalLM(nn.Module):
    """`quantization` picks the weight format of every projection and of the embedding/LM head: "none"
    (the model's dtype), "int8" (weight-only, per-channel scales) or "int8-head" (the model's dtype but for
    an int8 LM head and int4/int8 copies of the projections at decode sizes); see
    `runtime/layers/quantized.py` and `runtime/layers/decode_linear.py`."""

    def __init__(self, config: Gemma3Config, quantization: str = "none") -> None:
        super().__init__()
        if quantization not in WEIGHT_FORMATS:
            raise ValueError(f"quantization must be one of {', '.join(WEIGHT_FORMATS)}, got {quantization!r}")
        self.config = config
        self.quantization = quantization
        self.layers_compiled = False
        self.decode_arena = None  # where `build_model` placed the decode copies (runtime/layers/weight_arena.py)
        self.model = Gemma3Model(config, quantization)
        head = WEIGHT_FORMATS[quantization].head
        self.lm_head = None if config.tie_word_embeddings else head(config.hidden_size, config.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states (T, hidden) of the flattened batch; `positions` are each token's own position."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, vocab) float32
        module = self.model.embed_tokens if self.lm_head is None else self.lm_head
        if hasattr(module, "logits"):  # an int8 head: float32 from its kernel, without a round trip
            logits = module.logits(hidden)
        else:
            logits = (module.attend(hidden) if self.lm_head is None else module(hidden)).float()  # (T, vocab)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def compile_layers(self) -> None:
        """Compile each layer's math around its attention call (see `Gemma3DecoderLayer.compile_math`)."""
        for layer in self.model.layers:
            layer.compile_math()
        self.layers_compiled = True

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (that of the norm weights, whatever format the projections use)."""
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device
