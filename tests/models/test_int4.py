"""Exactly-4-bit projections: the grid is found (or declined) exactly, the int4 copy computes what the float
weight does, at decode sizes only, and nothing of it is saved."""

import pytest
import torch
import torch.nn.functional as F

from runtime.layers import int4
from runtime.layers.int4 import GROUP, INT4_MAX_ROWS, Int4GridLinear, int4_grid
from runtime.layers.quantized import kernel_path_only
from runtime.memory_bound import decode_weight_bytes
from runtime.models.config import Gemma3Config
from runtime.models.loader import build_model, random_state_dict

needs_kernel = pytest.mark.skipif(not int4.KERNEL_AVAILABLE, reason="torch has no CPU int4 kernel here")


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
def test_int4_linear_computes_what_the_float_weight_does_at_decode_sizes_only():
    torch.manual_seed(0)
    w = q4k_like(96, 128)
    layer = Int4GridLinear(128, 96).to(torch.bfloat16)
    layer.load_state_dict({"weight": w})
    assert layer.int4 is not None and "int4" in repr(layer)
    assert list(layer.state_dict()) == ["weight"]  # derived, never saved
    for rows in (1, INT4_MAX_ROWS):
        x = torch.randn(rows, 128).bfloat16()
        with torch.no_grad():
            got, dense = layer(x), F.linear(x, w.bfloat16())
        ref = F.linear(x.float(), w)
        # as close as the bfloat16 weight gets: the scales' rounding against every weight's
        assert (got.float() - ref).abs().max() <= 2 * (dense.float() - ref).abs().max()
    x = torch.randn(INT4_MAX_ROWS + 1, 128).bfloat16()
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight))  # more rows: the bfloat16 weight
        with kernel_path_only():
            assert torch.equal(layer(x), layer.int4.matmul(x))  # the quality benchmark's decode path


def test_float32_models_and_bfloat16_reads_keep_no_int4_copy():
    w = q4k_like(96, 128)
    layer = Int4GridLinear(128, 96)  # float32
    layer.load_state_dict({"weight": w})
    assert layer.int4 is None


@needs_kernel
def test_the_memory_floor_counts_the_int4_bytes():
    config = Gemma3Config.tiny()
    state = random_state_dict(config, seed=0)
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    state[o_proj] = q4k_like(*state[o_proj].shape)
    plain = build_model(config, state, torch.bfloat16, quantization="int8-head")
    layer = plain.model.layers[0].self_attn.o_proj
    assert layer.int4 is not None
    with_int4 = decode_weight_bytes(plain, 1)
    saved = layer.weight.numel() * 2 - layer.int4.nbytes()
    layer.int4 = None
    assert with_int4 == decode_weight_bytes(plain, 1) - saved
