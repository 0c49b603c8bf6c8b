"""The int8 LM head (`--quantization int8-head`): for decode's few rows it is exactly torch's dynamically
quantised matmul (simulated here in float64 from the quantisation rules, not from the layer's own code),
beyond them exactly the float head; a model with it keeps every other weight in its dtype, and its state
dict is the plain model's."""

import pytest
import torch
from dense_backend import DenseCausalBackend

from runtime.context import ForwardContext, forward_context
from runtime.layers import quantized
from runtime.layers.linear import Embedding, Linear
from runtime.layers.quantized import Int8HeadEmbedding, Int8HeadLinear, quantize_per_channel
from runtime.models.config import Gemma3Config
from runtime.models.loader import build_model, random_state_dict


def _dynamic_int8_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ W^T as the dynamic kernel defines it, in float64: x quantised once over all its rows (asymmetric,
    unsigned, the range widened to include 0), W per output channel (symmetric int8)."""
    x = x.double()
    qmax = 127 if quantized.REDUCE_RANGE else 255
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = (hi - lo) / qmax
    zero = min(max(round(-lo / scale), 0), qmax)
    xq = torch.clamp(torch.round(x / scale) + zero, 0, qmax)
    q, scales = quantize_per_channel(weight)
    return ((xq - zero) * scale) @ (q.double() * scales.double()[:, None]).T


def _heads(weight: torch.Tensor, dtype: torch.dtype):
    """The int8 head as a tied embedding and as a linear layer, and the float embedding, loaded alike."""
    with torch.device("cpu"):
        layers = [Int8HeadEmbedding(*weight.shape), Int8HeadLinear(weight.shape[1], weight.shape[0]),
                  Embedding(*weight.shape)]
    for layer in layers:
        layer.load_state_dict({"weight": weight})  # float32 values, as the loader hands them
        layer.to(dtype)
    return layers


@pytest.mark.parametrize("rows", [1, 3, quantized.DYNAMIC_MAX_ROWS])
def test_few_rows_are_the_dynamic_int8_matmul(rows):
    torch.manual_seed(0)
    weight = torch.randn(300, 64) * torch.logspace(-2, 1, 300)[:, None]
    x = torch.randn(rows, 64)
    emb, lin, plain = _heads(weight, torch.float32)
    expected = _dynamic_int8_reference(x, weight)
    with torch.no_grad():
        for out in (emb.attend(x), lin(x), emb.attend(x[None])[0]):
            assert out.dtype == torch.float32
            torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
        # the quantisation is visible: the float head is far from it at this tolerance
        assert float((plain.attend(x).double() - expected).abs().max()) > 1e-3


def test_bfloat16_activations_get_the_int8_result_rounded_to_bfloat16():
    torch.manual_seed(1)
    weight = torch.randn(200, 64)
    emb, _, plain = _heads(weight, torch.bfloat16)
    x = torch.randn(2, 64).to(torch.bfloat16)
    with torch.no_grad():
        out = emb.attend(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _dynamic_int8_reference(x.float(), weight), rtol=2**-8, atol=1e-6)


def test_more_rows_take_the_float_weight_bit_for_bit():
    torch.manual_seed(2)
    weight = torch.randn(300, 64)
    for dtype in (torch.float32, torch.bfloat16):
        emb, lin, plain = _heads(weight, dtype)
        x = torch.randn(quantized.DYNAMIC_MAX_ROWS + 1, 64).to(dtype)
        with torch.no_grad():
            assert torch.equal(emb.attend(x), plain.attend(x))
            assert torch.equal(lin(x), plain.attend(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_with_an_int8_head_is_the_plain_model_but_for_its_logits(dtype):
    """...and, in bfloat16 on our kernels (AVX512-VNNI or AVX2), but for its projections: their low-bit copies take every
    row count there (tests/models/test_decode_linear.py), so the hidden states are the plain model's only
    within the int8 activation blocks' error."""
    config = Gemma3Config.tiny()
    state = random_state_dict(config, seed=0, lively=False)
    plain = build_model(config, state, dtype)
    model = build_model(config, state, dtype, quantization="int8-head")
    assert model.quantization == "int8-head"
    assert isinstance(model.model.embed_tokens, Int8HeadEmbedding)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Linear)  # plus int4/int8 copies for decode
    assert list(model.state_dict()) == list(plain.state_dict())  # nothing int8 is saved: it is re-made on load
    ids = torch.tensor([3, 17, 200, 5, 9, 11, 42, 7, 100, 250])  # more rows than torch's int8 kernels take
    positions = torch.arange(len(ids))
    ctx = ForwardContext(forward_id=1, mode="eager_extend", attn_backend=DenseCausalBackend())
    with torch.no_grad():
        with forward_context(ctx):
            hidden, hidden_plain = model(ids, positions), plain(ids, positions)
        copies = model.model.layers[0].self_attn.qkv_proj.decode
        if copies is not None and copies.max_rows >= len(ids):  # our kernels
            torch.testing.assert_close(hidden.float(), hidden_plain.float(), rtol=0.1, atol=0.1)
            assert not torch.equal(hidden, hidden_plain)
        else:
            assert torch.equal(hidden, hidden_plain)
        last = hidden[-1:]
        rtol = 2**-8 if dtype == torch.bfloat16 else 1e-5
        # quantised from the checkpoint's float32 values, not from their copy in the model's dtype
        torch.testing.assert_close(model.compute_logits(last).double(), _dynamic_int8_reference(
            last.float(), state["model.embed_tokens.weight"]), rtol=rtol, atol=1e-5)
        # a model's own state dict loads too (its int8 copy then quantised from the weight in its dtype)
        saved = model.state_dict()
        reloaded = build_model(config, saved, dtype, quantization="int8-head")
        torch.testing.assert_close(reloaded.compute_logits(last).double(), _dynamic_int8_reference(
            last.float(), saved["model.embed_tokens.weight"].float()), rtol=rtol, atol=1e-5)
