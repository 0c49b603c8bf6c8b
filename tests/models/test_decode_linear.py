"""Decode copies of projections: an exactly-4-bit weight's grid is found (or declined) exactly; the int4 or
int8 copy computes what the float weight does, at decode sizes only; nothing of it is saved."""

import pytest
import torch
import torch.nn.functional as F

from runtime.layers import int4
from runtime import kernels
from runtime.layers.decode_linear import INT8_MAX_ROWS, VNNI_MAX_ROWS, DecodeLinear, Int8DecodeWeight
from runtime.layers.int4 import GROUP, INT4_MAX_ROWS, Int4Weight, int4_grid
from runtime.layers.quantized import kernel_path_only
from runtime.memory_bound import decode_weight_bytes
from runtime.models.config import Gemma3Config
from runtime.models.loader import build_model, random_state_dict

needs_kernel = pytest.mark.skipif(not int4.KERNEL_AVAILABLE and not int4._vnni(), reason="no CPU int4 kernel here")


def q4k_like(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """float32 values as a GGUF Q4_K tensor dequantises: `s * q - m` per group of 32, q in 0..15, some groups
    using only part of the range, one constant."""
    gen = torch.Generator().manual_seed(seed)
    groups = cols // GROUP
    q = torch.randint(0, 16, (rows, groups, GROUP), generator=gen)
    q[0, 0] = torch.randint(3, 9, (GROUP,), generator=gen)  # levels 3..8 only
    q[1, 1] = 7  # a constant group
    s = torch.rand(rows, groups, 1, generator=gen) * 0.01 + 1e-4
    m = s * (7.5 + torch.randn(rows, groups, 1, generator=gen))  # groups roughly centred on 0, as trained weights
    return (s * q.float() - m).reshape(rows, cols)


def test_a_4bit_weight_is_recovered_exactly():
    w = q4k_like(24, 128)
    q, step, low = int4_grid(w)
    assert q.dtype == torch.int32 and int(q.min()) >= 0 and int(q.max()) <= 15
    back = low.repeat_interleave(GROUP, 1) + step.repeat_interleave(GROUP, 1) * q
    assert bool(((back - w).abs() <= 1e-4 * step.repeat_interleave(GROUP, 1) + 1e-9).all())  # float32 rounding only
    assert step[1, 1] == 0 and int((step > 0).sum()) == step.numel() - 1  # the constant group alone: step 0


@pytest.mark.parametrize("weight", [
    torch.randn(24, 128),  # float weights
    torch.randint(-16, 16, (24, 128)).float() * 0.01,  # 32 levels (Q5_0-like)
    torch.randn(24, 100),  # columns not a multiple of the group
], ids=["float", "5bit", "ragged"])
def test_a_weight_that_is_not_4bit_is_declined(weight):
    assert int4_grid(weight) is None


@needs_kernel
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_the_decode_copy_computes_what_the_float_weight_does_at_decode_sizes_only(kind):
    torch.manual_seed(0)
    w = q4k_like(96, 128) if kind == "int4" else torch.randn(96, 128) * 0.05
    layer = DecodeLinear(128, 96).to(torch.bfloat16)
    layer.load_state_dict({"weight": w})
    assert isinstance(layer.decode, Int4Weight if kind == "int4" else Int8DecodeWeight) and kind in repr(layer)
    vnni = kernels.load() is not None and kernels.load().has_vnni()  # our int8 kernel: up to 8 rows
    assert layer.decode.max_rows == (INT4_MAX_ROWS if kind == "int4" else VNNI_MAX_ROWS if vnni else INT8_MAX_ROWS)
    assert list(layer.state_dict()) == ["weight"]  # derived, never saved
    for rows in (1, layer.decode.max_rows):
        x = torch.randn(rows, 128).bfloat16()
        with torch.no_grad():
            got, dense = layer(x), F.linear(x, w.bfloat16())
        ref = F.linear(x.float(), w)
        if kind == "int4" and layer.decode.projection is None:
            # torch's kernel: as close as the bfloat16 weight gets (the scales' rounding against every weight's)
            assert (got.float() - ref).abs().max() <= 2 * (dense.float() - ref).abs().max()
        else:  # per-channel int8: half a step of 1/127 of a row's largest weight; our kernels: int8 activation
            # blocks (tests/kernels holds their exact arithmetic)
            torch.testing.assert_close(got.float(), ref, rtol=0.05, atol=0.05)
    x = torch.randn(layer.decode.max_rows + 1, 128).bfloat16()
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight))  # more rows: the bfloat16 weight
        with kernel_path_only():
            assert torch.equal(layer(x), layer.decode.matmul(x))  # the quality benchmark's decode path


@needs_kernel
def test_the_memory_floor_counts_the_decode_copies_bytes():
    config = Gemma3Config.tiny()
    state = random_state_dict(config, seed=0)
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    state[o_proj] = q4k_like(*state[o_proj].shape)
    plain = build_model(config, state, torch.bfloat16, quantization="int8-head")
    layer = plain.model.layers[0].self_attn.o_proj
    assert isinstance(layer.decode, Int4Weight)
    assert isinstance(plain.model.layers[0].self_attn.qkv_proj.decode, Int8DecodeWeight)
    with_copy = decode_weight_bytes(plain, 1)
    saved = layer.weight.numel() * 2 - layer.decode.nbytes()
    layer.decode = None
    assert with_copy == decode_weight_bytes(plain, 1) - saved
