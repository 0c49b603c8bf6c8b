"""A Gemma 3 decoder layer at decode sizes through the fused CPU kernels (`runtime/kernels`: `layer_pre`,
`layer_post`), and what those two calls take, gathered once.

At one row of activations a layer's work besides its weights is a dozen small steps; with the kernels they
are two calls around the runtime's attention call, and what was left is the Python that gathers their
arguments: the four projections' low-bit copies and six norm multipliers, which cost ~25 us a layer to look
up and check (half a millisecond a step). `FusedPlan` holds them, and is used only while it still describes
the layer: the same copy objects on the projections (a `load_state_dict` makes new ones), and the same norm
weight objects at the versions they were read at (an in-place edit bumps the version): a stale plan, like a
stale location, must never be used, so every call checks it (~2 us).
"""

from __future__ import annotations

import torch

from runtime import kernels
from runtime.layers.module_call import call

# Rows up to which a decoder layer runs through the fused kernels: the low-bit kernels' limit, so that every
# projection takes its copy as `DecodeLinear` would.
FUSED_MAX_ROWS = 8


class FusedPlan:
    """What one layer's `layer_pre` and `layer_post` take: `projections` (qkv, o, gate/up, down copies in the
    kernels' layout, or None when some projection has none) and the norms' float32 multipliers."""

    def __init__(self, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        self.attention = attn.attn  # the runtime's attention call, looked up once (a submodule lookup is ~0.5 us)
        self.copies = tuple(getattr(m, "decode", None) for m in self.linears)
        projections = tuple(getattr(c, "projection", None) for c in self.copies)
        self.projections = None if any(p is None for p in projections) else projections
        norms = (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                 layer.post_feedforward_layernorm, attn.q_norm, attn.k_norm)
        self.norms = tuple((n, n._parameters["weight"], n._parameters["weight"]._version) for n in norms)
        self.scales = tuple(n.scale() for n in norms[:4])
        self.qk_scale = attn._qk_scale()
        self.eps = layer.input_layernorm.eps
        self.heads, self.kv_heads = attn.num_heads, attn.num_kv_heads

    def describes(self) -> bool:
        """Whether the layer still holds what this plan was made from."""
        for m, copy in zip(self.linears, self.copies):
            if getattr(m, "decode", None) is not copy:
                return False
        for n, w, version in self.norms:
            if n._parameters["weight"] is not w or w._version != version:
                return False
        return True


def plan_for(layer, h: torch.Tensor) -> FusedPlan | None:
    """The layer's plan when this forward can run through the fused kernels (bfloat16 rows on the CPU, no more
    than the kernels take, every projection with a copy in their layout); else None."""
    if h.shape[0] > FUSED_MAX_ROWS or kernels.for_tensor(h) is None:
        return None
    plan = layer._fused_plan
    if plan is None or not plan.describes():
        plan = layer._fused_plan = FusedPlan(layer)
    return plan if plan.projections is not None else None


def fused_forward(layer, plan: FusedPlan, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The layer's output for h (T, hidden): `layer_pre`, the runtime's attention call (the KV write through the
    location translation, the sanitizer, the backend), `layer_post`."""
    fused = kernels.load()
    qkv, o, gate_up, down = plan.projections
    q, k, v = fused.layer_pre(h, plan.scales[0], qkv, plan.qk_scale, plan.heads, plan.kv_heads, cos, sin, plan.eps)
    attn = call(plan.attention, q, k, v).contiguous()
    return fused.layer_post(h, attn, o, plan.scales[1], plan.scales[2], gate_up, down, plan.scales[3], plan.eps)
