"""The real Gemma 3 270M through the whole runtime (pools, translation cache, chunked prefill, graph replay)
against transformers on the same GGUF file, for a prompt longer than the 512-token window."""

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.core import SamplingParams
from runtime.models.loader import build_model
from telemetry.names import NON_BENIGN_CLASSIFICATIONS

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lantern and a "
    "notebook in which he recorded the weather, the ships that passed, and the birds that rested on the "
    "railing. Over forty years the notebooks filled a whole shelf in the cottage below. "
)


@pytest.fixture(scope="module")
def reference(our_gguf_f32, hf_gguf_model, gemma3_gguf_path):
    """The prompt, transformers' prefill logits at its last token, and its greedy continuation."""
    from runtime.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(gemma3_gguf_path)
    prompt = tokenizer.encode(PASSAGE * 12 + "In the end, the keeper")
    with torch.no_grad():
        ref_prefill = hf_gguf_model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
        ref_out = hf_gguf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                         min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()
    return tokenizer, prompt, ref_prefill, ref_out


@pytest.mark.parametrize("policy", ["memo", "off"])
def test_prefill_logits_and_greedy_continuation_match_transformers(policy, our_gguf_f32, reference):
    config, state = our_gguf_f32
    tokenizer, prompt, ref_prefill, ref_out = reference
    assert len(prompt) > config.sliding_window + 64
    cfg = EngineConfig(model="gemma3-270m", dtype="float32", quantization="none", loc_cache=policy, max_total_tokens=2048, swa_full_tokens_ratio=0.5,
                       chunked_prefill_size=256, graph_batch_sizes=(1,))
    engine = Engine(cfg, model=build_model(config, state, torch.float32), tokenizer=tokenizer)
    logits = []
    (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True), logits_out=logits)
    diff = (logits[0][0] - ref_prefill).abs().max().item()
    print(f"\n{policy}: {len(prompt)}-token prompt, max |prefill logits - transformers| = {diff:.3e}; "
          f"ours {out} transformers {ref_out}; text: {tokenizer.decode(out)!r}")
    assert diff < 1e-2
    assert out == ref_out
    assert engine.stats.forward_counts["graph_replay"] == NEW_TOKENS - 1
    assert engine.stats.swa_evicted_tokens > 0  # the window slid: SWA slots were given back
    t = engine.stats.translation
    assert not any(v for (site, cls), v in t.key_change_counts.items() if cls in NON_BENIGN_CLASSIFICATIONS)
