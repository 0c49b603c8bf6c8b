"""The fused decoder layer (`runtime/kernels`: `layer_pre` and `layer_post` around the runtime's attention call)
inside the engine: a bfloat16 `int8-head` model generates, request for request, what the same model generates
through its per-operation path, with the attention call between the two halves still writing through the
location translation and the KV sanitizer."""

import pytest
import torch

from runtime import kernels
from runtime.config import EngineConfig
from runtime.core import SamplingParams
from runtime.engine import Engine
from runtime.models import fused_decode
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
    if module is None or not module.has_vnni():
        pytest.skip("the fused decode layer needs the kernels' AVX512-VNNI build")
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
    layer_pre = fused_kernels.layer_pre
    monkeypatch.setattr(fused_kernels, "layer_pre", lambda h, *a: calls.append(h.shape[0]) or layer_pre(h, *a))
    # four requests at a time decode through the fused layers; ten at a time (more rows than the kernels
    # take) through the per-operation path in the same run
    fused = [generate(model, PROMPTS[:4]), generate(model, PROMPTS)]
    assert 4 in calls and set(calls) <= set(range(1, 9))  # (8: the graph capture of batch size 8)
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
    assert fused_decode.plan_for(layer, torch.randn(9, CONFIG.hidden_size).bfloat16()) is None  # too many rows
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
