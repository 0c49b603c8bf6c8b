"""Gemma 3 text model over the flattened tokens of a batch.

`model(input_ids (T,), positions (T,)) -> hidden (T, hidden)`; `model.compute_logits(hidden) -> (T, vocab)`
in float32. Attention itself is delegated to the backend of the forward context (see
`runtime/layers/attention.py`), so the model never sees requests, masks or KV caches.

Parameter names follow Hugging Face's `Gemma3ForCausalLM` (`model.layers.N.self_attn.q_proj.weight`, ...),
and norm weights use its zero-centred `1 + w` parameterisation.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.layers.activation import gelu_tanh_and_mul
from runtime.layers.attention import Attention
from runtime.layers.linear import Embedding, Linear
from runtime.layers.norm import RMSNorm
from runtime.layers.rotary import RotaryEmbedding
from runtime.models.config import Gemma3Config


class Gemma3MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size)
        self.up_proj = Linear(hidden_size, intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, hidden)
        return self.down_proj(gelu_tanh_and_mul(self.gate_proj(x), self.up_proj(x)))  # (T, I) inside


class Gemma3Attention(nn.Module):
    """Projections, per-head q/k RMSNorm and RoPE around the backend-agnostic `Attention`."""

    def __init__(self, config: Gemma3Config, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        # NOTE: shared with other layers of the same kind; kept out of the module tree (a plain attribute
        # in a tuple) so it is neither listed once per layer nor part of the state dict.
        self._rotary = (rotary,)
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

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # (T,), (T, hidden)
        T = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(T, self.num_heads, self.head_dim))  # (T, H, D)
        k = self.k_norm(self.k_proj(x).view(T, self.num_kv_heads, self.head_dim))  # (T, Hkv, D)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v))  # (T, H*D) -> (T, hidden)


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms: each sub-block's input and output are normalised before the residual add."""

    def __init__(self, config: Gemma3Config, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_id, rotary)
        self.mlp = Gemma3MLP(hidden, config.intermediate_size)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:  # (T,), (T, hidden)
        h = h + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(h)))
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h  # (T, hidden)


class Gemma3Model(nn.Module):
    def __init__(self, config: Gemma3Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
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
            Gemma3DecoderLayer(config, i, ropes[(config.rope_base(i), config.rope_factor(i))])
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # (T,), (T,)
        h = self.embed_tokens(input_ids)  # (T, hidden)
        h = h * self.embed_scale.to(h.dtype)
        for layer in self.layers:
            h = layer(positions, h)
        return self.norm(h)  # (T, hidden)


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, config: Gemma3Config) -> None:
        super().__init__()
        self.config = config
        self.model = Gemma3Model(config)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states (T, hidden) of the flattened batch; `positions` are each token's own position."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, vocab) float32
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = torch.nn.functional.linear(hidden, weight).float()  # (T, vocab)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device
