"""Small integer tensors from Python ints, built cheaply.

`torch.tensor(list)` costs ~2 us whatever the length (it inspects each element's type), and a decode step
builds about twenty such tensors of a few elements each. Packing the ints into an `array` and viewing its
buffer costs ~0.7 us. The tensor shares the array's memory, which it keeps alive. The other way, the range of
a small tensor is cheaper read through a list than through two reductions (0.4 against 2.1 us).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

import torch

_CODES = {torch.int64: "q", torch.int32: "i"}
assert array("q").itemsize == 8 and array("i").itemsize == 4, "the array type codes' sizes differ here"


def int_tensor(values: Iterable[int], dtype: torch.dtype = torch.int64, device=None) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` for ints (int64 or int32), without its per-element
    type inspection. Raises TypeError for a value that is not an int, OverflowError for one out of range."""
    data = array(_CODES[dtype], values)
    out = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
    return out if device is None or device == "cpu" or getattr(device, "type", None) == "cpu" else out.to(device)


SMALL = 32  # up to this many elements, a list is the cheaper way to a tensor's range


def bounds(t: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty integer tensor, as ints (of a device tensor: a sync, as `int(t.min())` was)."""
    if t.numel() <= SMALL:
        values = (t if t.dim() == 1 else t.reshape(-1)).tolist()
        return min(values), max(values)
    lo, hi = torch.aminmax(t)
    return int(lo), int(hi)
