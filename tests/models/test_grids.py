"""The grids of dequantised weights found in one pass (`runtime/kernels/grids.cpp`) against the torch search
(`grid_in_torch`): the same grids, the same refusals, on made-up weights and on the default model's."""

import pytest
import torch

from runtime import kernels
from runtime.layers import int4, int8_blocks
from runtime.models.loader import gguf_to_param_name

from test_decode_linear import q4k_like, symmetric_blocks_like

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="the fused CPU kernels are not built here")


def _one_pass_int8(w):
    return kernels.load().int8_block_grid(w, int8_blocks.CANDIDATES, int8_blocks.TOLERANCE)


def _one_pass_int4(w):
    return kernels.load().int4_grid(w, int4.GRID_TOLERANCE)


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def _edge_blocks() -> torch.Tensor:
    """Q5_0-like rows with blocks whose values are all 0 or all -16 units: a coarser grid than the block's own fits."""
    w = symmetric_blocks_like(16, 128, -16, seed=3)
    w[0, :32] = 0
    w[1, :32] = torch.where(torch.arange(32) % 2 == 0, -16.0, 0.0) * 0.0078125  # float16 steps: 1/128, 16/127 not
    w[2, 32:64] = 0.5  # one level, not 0
    return w


@pytest.mark.parametrize("make", [
    lambda: symmetric_blocks_like(48, 256, -16), lambda: symmetric_blocks_like(48, 256, 127), _edge_blocks,
    lambda: q4k_like(48, 256), lambda: torch.randn(48, 256), lambda: torch.randint(-127, 128, (16, 64)) * 0.003,
], ids=["q5_0", "q8_0", "edges", "q4_k", "float", "not-float16"])
def test_one_pass_finds_what_the_torch_search_finds(make):
    w = make().float().contiguous()
    assert _same(_one_pass_int8(w), int8_blocks.grid_in_torch(w))
    assert _same(_one_pass_int4(w), int4.grid_in_torch(w))


def test_the_grids_found_give_the_weight_back_exactly():
    w = _edge_blocks()
    q, step = _one_pass_int8(w)
    assert torch.equal(q.float() * step.repeat_interleave(32, 1), w)
    assert step[0, 0] == 0 and step[1, 0] == 0.0078125 and int(q[1, :32].min()) == -16
    w4 = q4k_like(16, 128)
    q4, step4, low4 = _one_pass_int4(w4)
    back = low4.repeat_interleave(32, 1) + step4.repeat_interleave(32, 1) * q4
    assert bool(((back - w4).abs() <= 1e-4 * step4.repeat_interleave(32, 1) + 1e-9).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_value_that_is_not_finite_is_on_no_grid(bad):
    for w in (symmetric_blocks_like(16, 64, 127), q4k_like(16, 64)):
        w[5, 40] = bad
        assert _one_pass_int8(w) is None and _one_pass_int4(w) is None
    zeros = torch.zeros(16, 64)
    zeros[0, 0] = float("nan")  # a block of zeros and one NaN is not an all-zero block
    assert _one_pass_int8(zeros) is None and _one_pass_int4(zeros) is None


def test_bad_arguments_are_refused():
    with pytest.raises(RuntimeError, match="multiple of 32"):
        _one_pass_int8(torch.zeros(4, 40))
    with pytest.raises(RuntimeError, match="float32"):
        _one_pass_int4(torch.zeros(4, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="1..127"):
        kernels.load().int8_block_grid(torch.zeros(4, 64), [128], 1e-3)


def test_the_default_models_weights_get_the_same_grids(our_gguf_f32, gguf_file):
    """The first 64 rows of one tensor of each block type (the torch search over whole tensors takes a minute)."""
    _, state = our_gguf_f32
    firsts = {}
    for tensor in gguf_file.tensors:
        if len(tensor.shape) == 2:
            firsts.setdefault(tensor.tensor_type.name, gguf_to_param_name(tensor.name))
    assert {"Q8_0", "Q5_0", "Q4_K", "Q6_K"} <= set(firsts)
    found = {}
    for kind, name in firsts.items():
        w = state[name][:64].contiguous()
        eight, four = _one_pass_int8(w), _one_pass_int4(w)
        assert _same(eight, int8_blocks.grid_in_torch(w)) and _same(four, int4.grid_in_torch(w)), name
        found[kind] = (eight is not None, four is not None)
    # Q8_0 and Q5_0 are int8 per block, Q4_K exactly 4-bit, Q6_K neither
    assert found == {"Q8_0": (True, False), "Q5_0": (True, False), "Q4_K": (False, True), "Q6_K": (False, False)}
