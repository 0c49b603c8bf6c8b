"""The whole runtime against transformers' Gemma 3 on tiny random models.

Windows 4 and 16, page sizes 1 and 4, mixed-length batches with prompts longer than the window, chunked
prefill, decode across window boundaries; every policy, torch and Triton (interpreter) backends, eager and
graph replay. Logits at every generated position must match a teacher-forced transformers forward over the
same tokens, greedy tokens must match transformers' own greedy generate, and a clean run must raise no
key-change event other than benign ones.
"""

import pytest
import torch
from transformers import Gemma3ForCausalLM as HFGemma3ForCausalLM
from transformers import Gemma3TextConfig

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.core import SamplingParams
from runtime.models.config import Gemma3Config
from runtime.models.loader import build_model, random_state_dict
from runtime.models.tokenizer import ByteTokenizer
from telemetry.names import NON_BENIGN_CLASSIFICATIONS

NEW_TOKENS = 10
PROMPT_LENS = (3, 9, 21)


def hf_twin(config, state):
    hf = HFGemma3ForCausalLM._from_config(Gemma3TextConfig(**config.to_hf_dict(), attn_implementation="eager"),
                                          dtype=torch.float32)
    hf.load_state_dict(state, strict=False)
    return hf.eval()


@pytest.fixture(scope="module", params=[4, 16], ids=lambda w: f"window{w}")
def setup(request):
    config = Gemma3Config.tiny(sliding_window=request.param)
    state = random_state_dict(config, seed=request.param)
    gen = torch.Generator().manual_seed(request.param)
    prompts = [torch.randint(4, 260, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    hf = hf_twin(config, state)
    greedy = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=0)
            greedy.append(out[0, len(p):].tolist())
    return config, state, prompts, hf, greedy


def make_engine(setup, device="cpu", **cfg) -> Engine:
    config, state = setup[0], setup[1]
    # No prefix cache unless asked: the checks below count every gather and expect the pools empty after a run.
    defaults = dict(model="tiny", max_total_tokens=256, swa_full_tokens_ratio=0.5, chunked_prefill_size=12,
                    max_running_requests=4, graph_batch_sizes=(1, 2, 4), disable_prefix_caching=True, device=device)
    return Engine(EngineConfig(**(defaults | cfg)), model=build_model(config, state, torch.float32, device=device),
                  tokenizer=ByteTokenizer())


def run(setup, device="cpu", **cfg):
    prompts = setup[2]
    engine = make_engine(setup, device, **cfg)
    logits = []
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True), logits_out=logits)
    return engine, outs, logits


def check(setup, engine, outs, logits):
    config, state, prompts, hf, greedy = setup
    assert outs == greedy
    for p, out, ours in zip(prompts, outs, logits):
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([p + out])).logits[0].float()
        torch.testing.assert_close(ours, ref[len(p) - 1:len(p) - 1 + NEW_TOKENS], rtol=0, atol=1e-4)
    t = engine.stats.translation
    bad = {k: v for k, v in t.key_change_counts.items() if v and k[1] in NON_BENIGN_CLASSIFICATIONS}
    assert bad == {}
    a = engine.pool.allocator
    assert a.full.available_size() == a.full.size and a.swa.available_size() == a.swa.size
    assert int(a.full_to_swa_index_mapping[:-1].abs().sum()) == 0
    return t


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("policy", ["memo", "layerwise", "per_forward", "off"])
def test_torch_backend_matches_transformers(setup, policy, graphs, page_size):
    engine, outs, logits = run(setup, loc_cache=policy, graphs=graphs, page_size=page_size)
    t = check(setup, engine, outs, logits)
    sliding = len(engine.model_config.sliding_layer_ids)
    forwards = sum(engine.stats.forward_counts.values())
    captures = 3 * 3 if graphs else 0  # (2 warm-up + 1 capture) x 3 batch sizes
    runs = forwards + captures
    if graphs:
        assert engine.stats.forward_counts["graph_replay"] == NEW_TOKENS - 1
    if policy in ("memo", "layerwise"):
        assert sum(t.hit_counts.values()) == runs * (sliding - 1)  # one write-path gather per forward
        assert sum(t.miss_counts.values()) == runs
        assert sum(t.key_change_counts.values()) == 0
    expected_gathers = {"memo": 2, "layerwise": 2, "per_forward": 2, "off": 1 + sliding}[policy]
    assert t.translation_count == runs * expected_gathers  # + 1: the window indices' one-off translation


# The interpreter is slow on CPU: every policy, mode and page size, spread over combinations rather than
# the full product.
@pytest.mark.parametrize("policy, graphs, page_size", [
    ("memo", False, 1), ("memo", True, 4), ("per_forward", True, 1), ("layerwise", False, 4), ("off", True, 1),
], ids=["memo-eager-page1", "memo-graph-page4", "per_forward-graph-page1", "layerwise-eager-page4", "off-graph-page1"])
def test_triton_backend_matches_transformers(setup, policy, graphs, page_size):
    engine, outs, logits = run(setup, loc_cache=policy, graphs=graphs, page_size=page_size,
                               attention_backend="triton")
    check(setup, engine, outs, logits)


# On a GPU the same runs go through CUDA tensors and Triton's compiled kernels (no interpreter). CI has no GPU:
# `gpu` tests skip there (tests/conftest.py) and run where one is lent (docs/performance.md, "On a GPU").
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("policy", ["memo", "per_forward", "off"])
def test_cuda_matches_transformers(setup, policy, graphs, backend):
    engine, outs, logits = run(setup, device="cuda", loc_cache=policy, graphs=graphs, page_size=4,
                               attention_backend=backend)
    check(setup, engine, outs, logits)
    assert engine.pool.allocator.full_to_swa_index_mapping.device.type == "cuda"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_prefix_cache_and_strict_sanitizer(setup, backend):
    """The same prompts twice on CUDA with the prefix cache on (the second pass reads the cached slots where a
    prompt's window was kept; windows leave tombstones) and every KV access checked: the same greedy tokens,
    no non-benign event."""
    config, state, prompts, hf, greedy = setup
    engine = make_engine(setup, "cuda", page_size=4, attention_backend=backend, kv_sanitizer="strict",
                         disable_prefix_caching=False)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert engine.generate(prompts, params) == greedy
    assert engine.generate(prompts, params) == greedy
    t = engine.stats.translation
    assert {k: v for k, v in t.key_change_counts.items() if v and k[1] in NON_BENIGN_CLASSIFICATIONS} == {}
    if config.sliding_window > min(PROMPT_LENS) + NEW_TOKENS:  # a short prompt kept its window: a cache hit
        assert engine.stats.prefix_cache.hit_tokens > 0
