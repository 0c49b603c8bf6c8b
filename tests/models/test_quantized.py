"""Weight-only int8: the layers against float math on their dequantised weights, both matmul paths, loading
from checkpoint names, and the engine refusing a model that does not match its config."""

import pytest
import torch
import torch.nn.functional as F

from runtime.config import QUANTIZATIONS, EngineConfig
from runtime.engine import Engine
from runtime.layers import quantized
from runtime.layers.quantized import Int8Embedding, Int8Linear, kernel_path_only, quantize_per_channel
from runtime.models.config import Gemma3Config
from runtime.models.gemma3 import WEIGHT_FORMATS
from runtime.models.loader import build_model, random_state_dict
from runtime.models.tokenizer import ByteTokenizer


def _dequantised(layer) -> torch.Tensor:
    return layer.weight_int8.float() * layer.scales[:, None]


def test_per_channel_rounding_error_is_at_most_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(64, 48) * torch.logspace(-3, 2, 64)[:, None]  # rows of very different magnitudes
    w[5] = 0.0
    q, scales = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32
    assert int(q.abs().max()) == 127 and torch.equal(q[5], torch.zeros_like(q[5]))
    error = (q.float() * scales[:, None] - w).abs()
    assert bool((error <= scales[:, None] / 2 + 1e-12).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, quantized.DEQUANT_MIN_ROWS + 3], ids=["1row", "5rows", "prefill"])
def test_int8_linear_is_a_matmul_with_the_dequantised_weight(dtype, rows):
    torch.manual_seed(1)
    weight = torch.randn(96, 64)
    layer = Int8Linear(64, 96)
    layer.load_state_dict({"weight": weight})
    assert layer.weight_int8.dtype == torch.int8
    x = torch.randn(rows, 64).to(dtype)
    got = layer(x)
    assert got.shape == (rows, 96) and got.dtype == dtype
    # the kernel rounds its inputs to bfloat16: compare with the same rounding
    x_in = x.float() if rows >= quantized.DEQUANT_MIN_ROWS else x.bfloat16().float()
    expected = F.linear(x_in, _dequantised(layer))
    tol = 1e-2 if dtype == torch.bfloat16 or rows < quantized.DEQUANT_MIN_ROWS else 1e-5
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol * float(expected.abs().max()))
    # and the quantisation itself stays close to the float weight
    assert (F.linear(x.float(), weight) - got.float()).abs().max() < 0.05 * F.linear(x.float(), weight).abs().max()


def test_both_paths_agree_and_the_kernel_path_can_be_forced():
    torch.manual_seed(2)
    layer = Int8Linear(64, 32)
    layer.load_state_dict({"weight": torch.randn(32, 64)})
    x = torch.randn(quantized.DEQUANT_MIN_ROWS, 64)
    dense = layer(x)
    with kernel_path_only():
        kernel = layer(x)
    assert not torch.equal(dense, kernel)  # the kernel path rounds activations and outputs to bfloat16
    torch.testing.assert_close(kernel, dense, rtol=1e-2, atol=1e-2 * float(dense.abs().max()))
    torch.testing.assert_close(kernel[:3], layer(x[:3]))  # outside the context: rows decide again


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_embedding_looks_up_and_projects_with_the_same_table(dtype):
    torch.manual_seed(3)
    table = torch.randn(300, 32)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as the loader builds a model: the embedding's output dtype
    try:
        emb = Int8Embedding(300, 32)
    finally:
        torch.set_default_dtype(previous)
    emb.load_state_dict({"weight": table})
    ids = torch.tensor([0, 7, 299, 7])
    rows = emb(ids)
    assert rows.dtype == dtype
    torch.testing.assert_close(rows.float(), _dequantised(emb)[ids].to(dtype).float())
    h = torch.randn(2, 32)
    expected = F.linear(h.bfloat16().float(), _dequantised(emb))
    torch.testing.assert_close(emb.attend(h), expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_model_loads_checkpoint_names_and_stays_close_to_float32(dtype):
    config = Gemma3Config.tiny()
    state = random_state_dict(config, seed=0, lively=False)
    model = build_model(config, state, dtype, quantization="int8")
    assert model.quantization == "int8" and model.dtype == dtype
    assert "model.layers.0.self_attn.q_proj.weight" in state  # the caller's dict is left as it was
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int8Linear) and isinstance(layer.mlp.down_proj, Int8Linear)
    assert isinstance(model.model.embed_tokens, Int8Embedding)
    # the merged q/k/v weight quantised from the checkpoint's three entries, in order
    qkv = torch.cat([state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(_dequantised(layer.self_attn.qkv_proj), qkv, rtol=0,
                               atol=float(qkv.abs().max()) / 127)
    reloaded = build_model(config, model.state_dict(), dtype, quantization="int8")  # its own names load too
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()))


def test_config_and_model_know_the_same_weight_formats():
    assert QUANTIZATIONS == ("auto", *WEIGHT_FORMATS)  # auto: resolved to one of them (runtime/auto_settings.py)
    with pytest.raises(ValueError, match="--quantization must be one of auto, none, int8, int8-head"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization must be one of"):
        build_model(Gemma3Config.tiny(), {}, quantization="fp8")


def test_engine_refuses_a_model_built_for_another_config():
    config = Gemma3Config.tiny()
    model = build_model(config, random_state_dict(config, seed=0), torch.float32)
    with pytest.raises(ValueError, match="does not match the config's quantization='int8'"):
        Engine(EngineConfig(model="tiny", quantization="int8", graphs=False, max_total_tokens=256,
                            swa_full_tokens_ratio=0.5), model=model, tokenizer=ByteTokenizer())
