"""The fused decoder layer (`runtime/kernels`: `layer_pre` and `layer_post` around the runtime's attention call)
inside the engine: a bfloat16 `int8-head` model generates, request for request, what the same model generates
through its per-operation path, with the attention call between the two halves still writing through the
location translation and the KV sanitizer; and all layers in one call (`DecodeStack`), which gives the per-layer
path's values bit for bit after the same lookups and checks."""

import pytest
import torch

from runtime import kernels
from runtime.config import EngineConfig
from runtime.core import SamplingParams
from runtime.engine import Engine
from runtime.models import fused_decode, gemma3
from runtime.mem_cache.swa_pool import HybridKVPool
from runtime.models.config import Gemma3Config
from runtime.models.loader import build_model, random_state_dict
from runtime.models.tokenizer import ByteTokenizer
from telemetry.names import NON_BENIGN_CLASSIFICATIONS

CONFIG = Gemma3Config.tiny()
STATE = random_state_dict(CONFIG, seed=0, lively=False)  # wide logit margins: no greedy near-ties
PROMPTS = [[2] + [(i * 37 + j) % 250 + 4 for i in range(12 + 3 * j)] for j in range(10)]


@pytest.fixture(scope="module")
def fused_kernels():
    module = kernels.load()
    if module is None or not module.has_low_bit():
        pytest.skip("the fused decode layer needs the kernels' low-bit build (AVX512-VNNI or AVX2)")
    return module


def generate(model, prompts) -> tuple[list[list[int]], list[torch.Tensor], Engine]:
    cfg = EngineConfig(model="tiny", dtype="bfloat16", quantization="int8-head", max_total_tokens=4096,
                       max_running_requests=16, chunked_prefill_size=64, graph_batch_sizes=(1, 2, 4, 8),
                       kv_sanitizer="strict")
    engine = Engine(cfg, progress=False, model=model, tokenizer=ByteTokenizer())
    logits: list[torch.Tensor] = []
    tokens = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True), logits_out=logits)
    return tokens, logits, engine


def test_fused_layers_generate_what_the_per_operation_path_does(fused_kernels, monkeypatch):
    model = build_model(CONFIG, STATE, torch.bfloat16, quantization="int8-head")
    assert all(fused_decode.FusedPlan(layer).projections is not None for layer in model.model.layers)  # every projection has its copy
    calls = []
    stack_forward = gemma3.stack_forward
    monkeypatch.setattr(gemma3, "stack_forward", lambda stack, h, *a: calls.append(h.shape[0]) or stack_forward(stack, h, *a))
    # four requests at a time decode through the fused layers (all of them in one call), their projections
    # streamed; ten at a time in tiles (past the streaming kernels' eight rows)
    fused = [generate(model, PROMPTS[:4]), generate(model, PROMPTS)]
    assert {4, 10} <= set(calls) and max(calls) <= fused_decode.FUSED_MAX_ROWS
    monkeypatch.setattr(fused_decode, "FUSED_MAX_ROWS", 0)
    calls.clear()
    per_op = [generate(model, PROMPTS[:4]), generate(model, PROMPTS)]
    assert calls == []
    for (tokens, logits, engine), (ref_tokens, ref_logits, _) in zip(fused, per_op):
        assert tokens == ref_tokens
        for got, ref in zip(logits, ref_logits):  # the same values but for rare roundings (the GELU's tanh)
            torch.testing.assert_close(got, ref, rtol=0.02, atol=0.05)
        events = engine.stats.translation.key_change_counts
        assert not {k: n for k, n in events.items() if n and k[1] in NON_BENIGN_CLASSIFICATIONS}


@torch.no_grad()  # the kernels serve inference only (the engine runs under no_grad)
def test_a_layers_plan_is_remade_when_what_it_holds_changes(fused_kernels):
    model = build_model(CONFIG, STATE, torch.bfloat16, quantization="int8-head")
    layer = model.model.layers[0]
    h = torch.randn(1, CONFIG.hidden_size).bfloat16()
    plan = fused_decode.plan_for(layer, h)
    assert plan is not None and fused_decode.plan_for(layer, h) is plan  # kept while it describes the layer
    assert fused_decode.plan_for(layer, torch.randn(9, CONFIG.hidden_size).bfloat16()) is plan  # in tiles
    too_many = torch.randn(fused_decode.FUSED_MAX_ROWS + 1, CONFIG.hidden_size).bfloat16()
    assert fused_decode.plan_for(layer, too_many) is None
    assert fused_decode.plan_for(layer, h.float()) is None  # float32: the exact path
    layer.pre_feedforward_layernorm.weight.add_(0.5)  # an in-place edit: its multiplier must be made again
    edited = fused_decode.plan_for(layer, h)
    assert edited is not plan
    torch.testing.assert_close(edited.scales[2], 1.0 + layer.pre_feedforward_layernorm.weight.float())
    model.load_state_dict(model.state_dict())  # new decode copies
    reloaded = fused_decode.plan_for(layer, h)
    assert reloaded is not edited and reloaded.projections[0] is layer.self_attn.qkv_proj.decode.projection
    layer.mlp.down_proj.decode = None  # a projection without a copy: the per-operation path
    assert fused_decode.plan_for(layer, h) is None


def counters(engine: Engine) -> dict:
    """What the translation and the KV sanitizer counted: lookups by path, misses by reason, events, gathers."""
    t = engine.stats.translation
    return {"hits": dict(t.hit_counts), "misses": dict(t.miss_counts), "events": dict(t.key_change_counts),
            "gathers": t.translation_count}


def generate_per_layer(model, prompts):
    """`generate` with a forward hook on the last layer, which runs between layers: the stack stands aside."""
    handle = model.model.layers[-1].register_forward_hook(lambda module, args, out: None)
    try:
        return generate(model, prompts)
    finally:
        handle.remove()


@pytest.mark.parametrize("patched_write", [False, True])
def test_the_stack_gives_the_per_layer_values_after_the_same_lookups_and_checks(fused_kernels, monkeypatch, patched_write):
    model = build_model(CONFIG, STATE, torch.bfloat16, quantization="int8-head")
    if patched_write:  # a write path that translates a copy of the location on each sliding layer: events
        original = HybridKVPool.set_kv_buffer
        monkeypatch.setattr(HybridKVPool, "set_kv_buffer",
                            lambda self, layer_id, loc, k, v, swa_loc=None: original(self, layer_id, loc.clone(), k, v, swa_loc))
    calls = []
    stack_forward = gemma3.stack_forward
    monkeypatch.setattr(gemma3, "stack_forward", lambda stack, h, *a: calls.append(h.shape[0]) or stack_forward(stack, h, *a))
    tokens, logits, engine = generate(model, PROMPTS)  # up to ten rows: streamed, and in tiles past eight
    stacked = len(calls)
    ref_tokens, ref_logits, ref_engine = generate_per_layer(model, PROMPTS)
    assert max(calls) > 8 and 1 in calls  # tiled and streamed projections both ran on the stack
    assert len(calls) == stacked  # the hook kept every forward of the second run off the stack
    assert tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits, strict=True))
    got, ref = counters(engine), counters(ref_engine)
    if not patched_write:
        assert got == ref
        assert not any(got["events"].values())
        return
    # The patched path's temporaries: each lookup misses; whether a temporary took the address of the one before
    # (stale_loc) or not (benign_fresh_tensor) follows the allocator, which the stack's fewer tensors change.
    # The lookups and events are the same in number, mode by mode.
    def per_mode(c):
        lookups = {mode: n + sum(m for (p, _), m in c["misses"].items() if p == mode) for mode, n in c["hits"].items()}
        return lookups, sum(c["events"].values()), c["gathers"]
    assert per_mode(got) == per_mode(ref)
    assert sum(got["events"].values()) > 0 and got["gathers"] > 0


@torch.no_grad()
def test_the_stack_is_remade_when_a_layer_or_an_end_changes_or_is_hooked(fused_kernels):
    model = build_model(CONFIG, STATE, torch.bfloat16, quantization="int8-head").model
    layers = model.layers

    def fresh():
        return fused_decode.FusedStack(model, [fused_decode.plan_for(layer, torch.zeros(1, CONFIG.hidden_size).bfloat16())
                                               for layer in layers])

    stack = fresh()
    assert stack.describes(layers)
    layers[1].post_feedforward_layernorm.weight.add_(0.25)  # in place: its multiplier is stale
    assert not stack.describes(layers)
    stack = fresh()
    assert stack.describes(layers)
    handle = layers[0].self_attn.attn.register_forward_pre_hook(lambda module, args: None)
    assert not stack.describes(layers)
    handle.remove()
    assert stack.describes(layers)
    layers[2].mlp.down_proj.decode = layers[2].mlp.down_proj.decode  # a copy set, even the same one
    assert not stack.describes(layers)
    stack = fresh()
    layers[3].input_layernorm.weight = torch.nn.Parameter(layers[3].input_layernorm.weight.clone())  # rebound
    assert not stack.describes(layers)
    # the ends the stack runs itself: the token table, its multiplier, the final norm
    for edit in (lambda: model.embed_tokens.weight[5].add_(1.0), lambda: model.embed_scale.mul_(2.0),
                 lambda: model.norm.weight.add_(0.5)):
        stack = fresh()
        assert stack.describes(layers)
        edit()
        assert not stack.describes(layers)
    for module in (model.embed_tokens, model.norm):
        stack = fresh()
        handle = module.register_forward_hook(lambda m, args, out: None)
        assert not stack.describes(layers)
        handle.remove()
        assert stack.describes(layers)
