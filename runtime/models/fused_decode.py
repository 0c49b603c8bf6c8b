"""A Gemma 3 decoder layer at decode sizes through the fused CPU kernels (`runtime/kernels`: `layer_pre`,
`layer_post`), and what those two calls take, gathered once.

At one row of activations a layer's work besides its weights is a dozen small steps; with the kernels they
are two calls around the runtime's attention call, and what was left is the Python that gathers their
arguments: the four projections' low-bit copies and six norm multipliers, which cost ~25 us a layer to look
up and check (half a millisecond a step). `FusedPlan` holds them, and is used only while it still describes
the layer: the same copy objects on the projections (a `load_state_dict` makes new ones), and the same norm
weight objects at the versions they were read at (an in-place edit bumps the version): a stale plan, like a
stale location, must never be used, so every call checks it (~2 us).

Even two calls a layer left the interpreter about 55 us a layer in a real step (the weights the kernels stream
sweep the caches its frames live in): a millisecond of a batch-1 step. `stack_forward` runs every layer in one
call (`DecodeStack`: per layer `layer_pre`, the KV write, decode attention, `layer_post`, the same kernels in the
same order as the per-layer path, so the same values bit for bit), and the model's ends with them: the token
rows and their multiplier, the rotary rows, the final norm (five torch operations, ~100 us cold a step). The
runtime's part of each layer's attention call, the location translation and the KV sanitizer's checks, runs
before it, layer by layer in the per-layer path's order, through the same methods
(`AttentionBackend.fused_decode_io`, `HybridKVPool.set_kv_buffer`), and hands the slots and keys in. It serves
when everything the per-layer path would do is in it: every layer has a plan, nothing is hooked on the embedding,
a layer, its attention or the final norm (diagnose's mid-forward remap hooks a layer: between two layers), and
the backend's attention is the torch backend's in-place decode.
"""

from __future__ import annotations

import torch
from torch.nn.modules import module as _module

from runtime import kernels
from runtime.context import get_forward_context
from runtime.layers.decode_linear import DecodeLinear
from runtime.layers.linear import Embedding
from runtime.layers.module_call import call, hooked

# Rows up to which a decoder layer runs through the fused kernels: decode batches (one row a request) up to 64,
# and extends as short. Past eight rows the projections run in tiles, as their copies do on the per-operation
# path; a layer whose copies take fewer rows keeps that path (with AMX they take as many: `OUR_MAX_ROWS`).
FUSED_MAX_ROWS = 64


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
        self.max_rows = min((c.max_rows for c in self.copies if c is not None), default=0)  # what every copy takes
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
    return _plan(layer, h.shape[0])


def _plan(layer, rows: int) -> FusedPlan | None:
    plan = layer._fused_plan
    if plan is None or not plan.describes():
        plan = layer._fused_plan = FusedPlan(layer)
    return plan if plan.projections is not None and rows <= plan.max_rows else None


def fused_forward(layer, plan: FusedPlan, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The layer's output for h (T, hidden): `layer_pre`, the runtime's attention call (the KV write through the
    location translation, the sanitizer, the backend), `layer_post`."""
    fused = kernels.load()
    qkv, o, gate_up, down = plan.projections
    q, k, v = fused.layer_pre(h, plan.scales[0], qkv, plan.qk_scale, plan.heads, plan.kv_heads, cos, sin, plan.eps)
    attn = call(plan.attention, q, k, v).contiguous()
    return fused.layer_post(h, attn, o, plan.scales[1], plan.scales[2], gate_up, down, plan.scales[3], plan.eps)


# Parameters, buffers and submodules (re)bound on any module since start-up (torch's global registration hooks):
# a rebinding in a layer makes its plan stale, and counting them all spares a stack the look at 180 attributes.
_rebinds = 0


def _count_rebind(*args) -> None:
    global _rebinds
    _rebinds += 1


_module.register_module_parameter_registration_hook(_count_rebind)
_module.register_module_buffer_registration_hook(_count_rebind)
_module.register_module_module_registration_hook(_count_rebind)


class FusedStack:
    """A model's layer plans and the parts around them (the token table and its multiplier, the final norm) as
    one `DecodeStack`, used while it still describes the model. Checking each layer's plan
    (`FusedPlan.describes`) costs ~0.2 ms at the start of a real step, with caches the weights swept: here the same
    facts are read from counters (a projection's copy set, something rebound on a module), the hook tables and,
    in C++, the versions of the weights its multipliers were made from."""

    def __init__(self, model, plans: list[FusedPlan]) -> None:
        self.copies_set, self.rebinds = DecodeLinear.copies_set, _rebinds
        self.plans = plans
        self.max_rows = min(plan.max_rows for plan in plans)
        self.attentions = [plan.attention for plan in plans]
        # the tables `call` looks in: a hook on the embedding, a layer, its attention or the final norm (the
        # per-layer path runs it: between layers, diagnose's mid-forward remap)
        modules = [model.embed_tokens, model.norm] + [m for layer, plan in zip(model.layers, plans)
                                                      for m in (layer, plan.attention)]
        self.hook_tables = [table for m in modules for table in (m._forward_hooks, m._forward_pre_hooks)]
        fused = kernels.load()
        stack = []
        for plan, table in zip(plans, model.layer_rope):
            qkv, o, gate_up, down = plan.projections
            attn = plan.attention
            stack.append(fused.StackLayer(qkv, o, gate_up, down, *plan.scales, plan.qk_scale, plan.heads,
                                          plan.kv_heads, table, plan.eps, attn.scaling, attn.logit_softcapping or 0.0,
                                          [w for _, w, _ in plan.norms], [v for _, _, v in plan.norms]))
        watched = [model.embed_tokens.weight, model.embed_scale, model.norm.weight]
        ends = fused.StackEnds(model.embed_tokens.weight, model.embed_scale, model.norm.scale(), model.norm.eps,
                               watched, [t._version for t in watched])
        self.stack = fused.DecodeStack(stack, ends)

    def describes(self, layers) -> bool:
        """Whether every layer's plan still describes it (`FusedPlan.describes`), the ends are as they were and
        nothing is hooked."""
        if (self.copies_set != DecodeLinear.copies_set or self.rebinds != _rebinds or len(layers) != len(self.plans)
                or _module._global_forward_hooks or _module._global_forward_pre_hooks or any(self.hook_tables)):
            return False
        return self.stack.current()


def stack_for(model, ids: torch.Tensor) -> FusedStack | None:
    """`model`'s (a `Gemma3Model`) stack when this forward over the tokens `ids` can run in one call: bfloat16
    on the CPU, a token table of that dtype, every layer with a plan (`plan_for`), nothing hooked, the backend
    attending in place; else None (the per-layer path)."""
    rows = ids.shape[0]
    dtype = model.norm.weight.dtype
    if rows > FUSED_MAX_ROWS or ids.dtype != torch.int64 or kernels.for_tensor(model.norm.weight) is None:
        return None
    backend = get_forward_context().attn_backend
    in_place = getattr(backend, "attends_in_place", None)  # a backend held to the contract alone has none
    if in_place is None or not in_place(dtype):
        return None
    layers = model.layers
    stack = model._fused_stack
    if stack is not None and stack.describes(layers):
        return stack if rows <= stack.max_rows else None
    embed = model.embed_tokens
    if not isinstance(embed, Embedding) or embed.weight.dtype != dtype or hooked(embed) or hooked(model.norm):
        return None
    plans = []
    for layer in layers:
        plan = _plan(layer, rows)
        if plan is None or hooked(layer) or hooked(plan.attention):
            return None
        plans.append(plan)
    stack = model._fused_stack = FusedStack(model, plans)
    return stack if rows <= stack.max_rows else None


def stack_forward(stack: FusedStack, ids: torch.Tensor, positions: torch.Tensor,
                  tables: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The final norm's rows (T, hidden) for the tokens `ids` at `positions`, each layer's translation and
    sanitizer checks done in order first; `tables`: each rotary table's full-width (cos, sin)."""
    backend = get_forward_context().attn_backend
    k_bufs, v_bufs, slots, indices, indptrs = [], [], [], [], []
    for attention in stack.attentions:
        k_buf, v_buf, loc, keys = backend.fused_decode_io(attention)
        k_bufs.append(k_buf)
        v_bufs.append(v_buf)
        slots.append(loc)
        indices.append(keys.indices)
        indptrs.append(keys.indptr)
    return stack.stack.run(ids, positions, [c for c, _ in tables], [s for _, s in tables], k_bufs, v_bufs, slots,
                           indices, indptrs)
