"""Calibration of the prefill path's copies: the activations' range per input column, from one forward over a
fixed text, smooths the int8 copies in blocks of 128 that take a projection's rows past eight
(`runtime/layers/decode_linear.py`: `make_tiles`, `smoothing`).

A block of 128 activations is quantised with one scale, and in Gemma 3 a few columns run tens of times larger
than the rest (up to 42x the median column's largest value in a `down_proj`). Dividing each column by a factor
found here, and multiplying the weight's column by it, leaves the product as it was and spreads the range: the
prefill path's KL divergence from float32 halved (docs/performance.md). The text mixes English prose, a question,
Python, numbers, a note, a recipe, a sentence each in German, Russian, Japanese and Chinese, C and JSON, so that the
columns see the kinds of input a server gets: calibrated on English alone, the other languages lost more than on
the GGUF's blocks. It was written for this and is not the text `benchmarks/quality.py` scores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.attention.sliding_window import seen_by
from runtime.context import ForwardContext, forward_context
from runtime.layers.decode_linear import DecodeLinear, make_tiles, set_prefill_weights

CALIBRATION_TEXT = (
    "The harbour town woke slowly. Fishing boats came in before six, their decks stacked with crates of mackerel "
    "and ice, and by eight the market hall was loud with prices called across the stalls. Mira kept the ledger for "
    "her uncle's stand: 42 kg sold on Monday, 37 on Tuesday, and a note that the scales needed checking again.\n\n"
    "Q: What is the capital of Australia?\nA: Canberra, not Sydney, although many people guess the larger city.\n\n"
    "def moving_average(values, window=3):\n    \"\"\"Mean of each run of `window` values.\"\"\"\n"
    "    return [sum(values[i:i + window]) / window for i in range(len(values) - window + 1)]\n\n"
    "In 1969 the first crewed landing on the Moon showed that careful engineering, tested step by step, could carry "
    "people across 384,000 kilometres and back. Today, students learn orbital mechanics with a laptop and a few "
    "equations: F = G m1 m2 / r^2, and the patience to check every unit.\n"
    "Dear team, the meeting moves to Thursday at 14:30 (room B2). Please bring the draft budget and your questions; "
    "we will decide on the new suppliers then. Thanks, Jonas\n"
    "Ingredients: 200 g flour, 2 eggs, 300 ml milk, a pinch of salt. Whisk, rest for twenty minutes, then fry thin "
    "pancakes in a hot pan with a little butter."
    "\nIm Herbst fahren wir mit dem Zug nach Hamburg; die Fahrt dauert knapp drei Stunden, und wir lesen unterwegs. "
    "Вечером мы долго говорили о книгах, а потом пошли гулять к реке. "
    "明日は雨が降るそうなので、傘を持って出かけてください。"
    "我们周末去图书馆借了几本关于历史的书。"
    "\nstatic int parse_line(const char *s, struct entry *out) {\n    if (!s || !*s) return -1;\n"
    "    out->key = strtol(s, NULL, 10);\n    return sscanf(s, \"%d %31s\", &out->id, out->name) == 2 ? 0 : -2;\n}\n"
    "{\"name\": \"cache\", \"size_mb\": 512, \"enabled\": true, \"tags\": [\"kv\", \"swa\"]}\n"
)


CALIBRATION_MAX_TOKENS = 1024  # Gemma's tokenizer gives 506; a byte tokenizer's ids run past a thousand


def calibration_ids(tokenizer, bos_token_id: int, positions: int) -> list[int]:
    """The calibration text's token ids after the beginning-of-sequence token, as a prompt starts; at most
    `CALIBRATION_MAX_TOKENS` and a model's `positions`."""
    return ([bos_token_id] + list(tokenizer.encode(CALIBRATION_TEXT)))[:min(CALIBRATION_MAX_TOKENS, positions)]


class SequenceAttention:
    """A forward-context backend for one sequence without a KV cache: token i sits at position i (causal,
    windowed on sliding layers, in float32)."""

    def forward(self, q, k, v, layer):  # q (T, H, D), k/v (T, Hkv, D) -> (T, H, D)
        T = q.shape[0]
        i = torch.arange(T, device=q.device)
        visible = seen_by(i, i, layer.sliding_window)  # (Tq, Tk)
        q32, k32, v32 = (x.float().transpose(0, 1)[None] for x in (q, k, v))  # (1, heads, T, D)
        out = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=visible, scale=layer.scaling,
                                             enable_gqa=True)  # (1, H, T, D)
        return out[0].transpose(0, 1).to(q.dtype)


def sequence_forward(model, ids: list[int], backend=None) -> torch.Tensor:
    """The final norm's rows (T, hidden) of `model` (a `Gemma3ForCausalLM`) over `ids` at positions 0..T-1;
    attention through `backend` (`forward(q, k, v, layer)`), by default `SequenceAttention`."""
    ids_t = torch.tensor(ids, device=model.device)
    ctx = ForwardContext(forward_id=1, mode="eager_extend", attn_backend=backend or SequenceAttention())
    with torch.no_grad(), forward_context(ctx, bind_logging=False):
        return model(ids_t, torch.arange(len(ids), device=ids_t.device))


def calibrate_prefill_weights(model, ids: list[int]) -> int:
    """Every projection that kept its float32 values for a tiles' copy (`DecodeLinear.tiles_source`) gets it,
    smoothed by its input columns' largest magnitudes over one forward of `ids` (through the copies it has: the
    GGUF's blocks). Returns how many. `ids` of more than eight tokens: fewer take the decode kernels, not the
    tiles whose inputs are measured."""
    modules = [m for m in model.modules() if isinstance(m, DecodeLinear) and m.tiles_source is not None]
    if not modules:
        return 0
    if len(ids) <= 8:
        raise ValueError(f"calibration needs more than 8 tokens (the rows the tiles take), got {len(ids)}")
    maxima: dict[DecodeLinear, torch.Tensor] = {}

    def record(module, args):
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float().abs().amax(0)
        maxima[module] = x if module not in maxima else torch.maximum(maxima[module], x)

    handles = [m.register_forward_pre_hook(record) for m in modules]
    try:
        sequence_forward(model, ids)
    finally:
        for h in handles:
            h.remove()
    for m in modules:
        make_tiles(m, maxima[m])
    return len(modules)


def prepare_prefill_weights(model, tiles: bool, tokenizer) -> int:
    """`--prefill-weights`: int8-128 (`tiles`) gives the projections that can take one their smoothed tiles'
    copy, calibrated on `CALIBRATION_TEXT` through `tokenizer`; gguf drops what was kept to make them. Returns
    how many projections run their rows past eight on a tiles' copy."""
    if tiles:
        config = model.config
        ids = calibration_ids(tokenizer, config.bos_token_id, config.max_position_embeddings)
        calibrate_prefill_weights(model, ids)
    return set_prefill_weights(model, tiles)
