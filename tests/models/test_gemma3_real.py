"""The real Gemma 3 270M (from the default GGUF file): against transformers on the same weights, and on
text whose continuation is not in doubt (a check that does not trust transformers' conversion either)."""

import pytest
import torch

from runtime.models.loader import build_model
from runtime.models.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lantern and a "
    "notebook in which he recorded the weather, the ships that passed, and the birds that rested on the "
    "railing. Over forty years the notebooks filled a whole shelf in the cottage below. "
    "In the village, the baker rose before dawn to light the ovens; by six o'clock the smell of fresh bread "
    "drifted down to the harbour, where fishermen mended their nets and argued about the tides. "
)


@pytest.fixture(scope="module")
def model(our_gguf_f32):
    config, state = our_gguf_f32
    return build_model(config, state, torch.float32)


@pytest.fixture(scope="module")
def tokenizer(gemma3_gguf_path):
    return load_tokenizer(gemma3_gguf_path)


def test_logits_match_transformers_on_a_prompt_longer_than_the_window(model, tokenizer, hf_gguf_model, run_dense):
    ids = torch.tensor(tokenizer.encode(PASSAGE * 6))
    window = model.config.sliding_window
    assert ids.numel() > window + 50
    # Logits of every 16th position and of every position past the window (the vocabulary is 262k wide:
    # all positions would cost more than the model itself).
    keep = torch.cat([torch.arange(0, window, 16), torch.arange(window, ids.numel())])
    ours = run_dense(_Keep(model, keep), ids)
    with torch.no_grad():
        ref = hf_gguf_model(input_ids=ids[None], logits_to_keep=keep).logits[0].float()
    diff = (ours - ref).abs().max().item()
    print(f"\nGemma 3 270M float32, {ids.numel()} tokens: max |logits - transformers| = {diff:.3e}")
    assert ref.std() > 1.0
    assert diff < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize(
    ("prompt", "continuation"),
    [
        ("Monday, Tuesday, Wednesday,", " Thursday, Friday,"),
        ("The capital of France is Paris. The capital of Germany is", " Berlin."),
    ],
)
def test_greedy_continuation_is_the_obvious_one(model, tokenizer, run_dense, prompt, continuation):
    ids = tokenizer.encode(prompt)
    prompt_len = len(ids)
    while not tokenizer.decode(ids[prompt_len:]).startswith(continuation) and len(ids) < prompt_len + 6:
        ids.append(int(run_dense(model, ids)[-1].argmax()))
    assert tokenizer.decode(ids[prompt_len:]) == continuation


class _Keep(torch.nn.Module):
    """The model with `compute_logits` restricted to some positions."""

    def __init__(self, model, keep):
        super().__init__()
        self.inner, self.keep = model, keep

    def forward(self, ids, positions):
        return self.inner(ids, positions)

    def compute_logits(self, hidden):
        return self.inner.compute_logits(hidden[self.keep])
