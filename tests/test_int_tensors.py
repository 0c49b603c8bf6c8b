"""`int_tensor` builds what `torch.tensor` builds from ints, and `bounds` reads what min/max read."""

from __future__ import annotations

import pytest
import torch

from runtime.int_tensors import SMALL, bounds, int_tensor


@pytest.mark.parametrize("values", [[7], [3, -1, 2**40, 0], list(range(600)), (5, 6), range(3, 9)])
def test_int_tensor_equals_torch_tensor(values):
    built = int_tensor(values)
    expected = torch.tensor(list(values), dtype=torch.int64)
    assert built.dtype == torch.int64 and built.shape == expected.shape and torch.equal(built, expected)


def test_int32_empty_and_independent_arrays():
    assert torch.equal(int_tensor([1, -2, 2**31 - 1], torch.int32), torch.tensor([1, -2, 2**31 - 1], dtype=torch.int32))
    empty = int_tensor([], torch.int32)
    assert empty.shape == (0,) and empty.dtype == torch.int32
    a, b = int_tensor([1, 2]), int_tensor([1, 2])
    a[0] = 9  # each call owns its memory: writing one leaves the other
    assert b.tolist() == [1, 2]


@pytest.mark.parametrize("bad, error", [([1.5], TypeError), (["3"], TypeError), ([2**63], OverflowError)])
def test_int_tensor_refuses_what_is_not_an_int_of_its_type(bad, error):
    with pytest.raises(error):
        int_tensor(bad)


def test_an_int32_tensor_refuses_what_int32_cannot_hold():
    with pytest.raises(OverflowError):
        int_tensor([2**31], torch.int32)


@pytest.mark.parametrize("n", [1, SMALL, SMALL + 1, 5000])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_bounds_are_min_and_max(n, dtype):
    t = torch.randint(-1000, 1000, (n,), generator=torch.Generator().manual_seed(n), dtype=dtype)
    lo, hi = bounds(t)
    assert (lo, hi) == (int(t.min()), int(t.max())) and isinstance(lo, int) and isinstance(hi, int)
    assert bounds(t.reshape(1, -1)) == (lo, hi)
