"""Weights that are exactly 4-bit, multiplied at decode sizes by an int4 kernel.

A GGUF file's Q4_K tensors (in Gemma 3 270M's Q4_K_M file: every `attn_output` and half of the `ffn_down`)
hold, in each group of 32 consecutive weights of a row, values `s * q - m` with q in 0..15: 16 evenly spaced
levels. Dequantised to float32 by the loader, such a weight is therefore exactly an asymmetric int4 weight
with one scale and one offset per group of 32. A decode step reads about a quarter of the bytes of the
bfloat16 copy for these weights. Two kernels:

- where the CPU has AVX512-VNNI or AVX2, ours (`runtime/kernels`, `Projection.int4`): the step and offset of each group
  kept in float32, so the weight is used exactly, and the activations quantised per block of 32 as for the
  int8 copies; it streams the weights at the memory's pace;
- else torch's `aten::_weight_int4pack_mm_for_cpu` (`(q - 8) * scale + zero`, scales and zeros rounded to the
  activations' dtype, relative 2^-9, about what rounding each weight to bfloat16 costs the bfloat16 copy),
  which streamed at about 9 GB/s on a 2-core Xeon (one row through a 640 x 1024 weight: 116 against 429 us
  prepacked bfloat16).

Ours takes every row count (prefill's in tiles: 1.2x prepacked bfloat16 at 600 rows on a 2-core EPYC); torch's
only up to `INT4_MAX_ROWS` rows (its cost grows with the rows faster than a GEMM's: 8 rows 1.2x faster than
bfloat16, 32 rows 2x slower), more keep the prepacked bfloat16 weight (the layer that chooses:
`runtime/layers/decode_linear.py`).

Nothing is re-quantised: `int4_grid` finds the grid or declines, so a weight that is not exactly 4-bit
(Q5_0, Q6_K, Q8_0, a Hugging Face checkpoint, float32 rounded to bfloat16 before loading) keeps its bfloat16
path alone.
"""

from __future__ import annotations

import torch

from runtime import kernels
from runtime.layers.grid_search import grid_steps
from runtime.layers.linear import CPU_HAS_AMX

GROUP = 32  # weights per (scale, offset): Q4_K's sub-block
LEVELS = 16
INT4_MAX_ROWS = 8  # rows up to which torch's int4 kernel is faster than prepacked bfloat16 (module docstring)
EVERY_ROW = 1 << 62  # a `max_rows` that takes any row count, prefill's too
# Rows our kernels' copies take (`OUR_MAX_ROWS`): every row count, prefill's in tiles of `vpdpbusd` (1.5x oneDNN's
# prepacked bfloat16 on AVX512-BF16). Where the CPU has AMX, oneDNN's bfloat16 tiles catch up with ours past about
# 64 rows (a layer's projections on a 2-core Xeon with AMX, ours against oneDNN's: 0.34x the time at 8 rows, 0.47x at
# 16, 0.59x at 32, 0.79x at 64, 1.0x at 96-128, 1.12x at 256), so there the copies take decode batches up to
# `AMX_MAX_ROWS` and prefill keeps the prepacked bfloat16 weight (docs/performance.md).
AMX_MAX_ROWS = 64
OUR_MAX_ROWS = AMX_MAX_ROWS if CPU_HAS_AMX else EVERY_ROW
GRID_TOLERANCE = 1e-3  # of a grid step: float32 rounding in `s * q - m`, far below a step
KERNEL_AVAILABLE = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
    torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def int4_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q (N, K) int32 in 0..15, step (N, K/32), low (N, K/32)) with weight == low + step * q per group of 32,
    or None if some group's values are not on 16 evenly spaced levels. Each group takes the finest grid,
    15 steps from its minimum to its maximum down to 1, that holds all of its values. The first rows are
    tried alone first: most weights that are not 4-bit fail there, at a fraction of the cost."""
    if weight.dim() != 2 or weight.shape[1] % GROUP:
        return None
    weight = weight.float().contiguous()
    if weight.shape[0] > SAMPLE_ROWS and _grid(weight[:SAMPLE_ROWS]) is None:
        return None
    return _grid(weight)


SAMPLE_ROWS = 8


def _grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    module = kernels.load()
    if module is not None:  # the same search in one pass (`runtime/kernels/grids.cpp`)
        return module.int4_grid(weight, GRID_TOLERANCE)
    return grid_in_torch(weight)


def grid_in_torch(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`int4_grid` of a float32 (N, K) weight in torch operations."""
    N, K = weight.shape
    w = weight.reshape(-1, GROUP)  # (N K/32, 32): one group a row
    low = w.amin(-1)
    offsets = w - low[:, None]
    # the finest grid first; a constant group is `low` alone: step 0
    step = grid_steps(offsets, offsets.amax(-1), range(LEVELS - 1, 0, -1), GRID_TOLERANCE)
    if step is None:
        return None
    q = (offsets / torch.where(step > 0, step, 1.0)[:, None]).round().to(torch.int32)
    return q.reshape(N, K), step.reshape(N, -1), low.reshape(N, -1)


class Int4Weight:
    """An exactly-4-bit weight in an int4 kernel's packed layout, next to the module's own weight: ours where
    the CPU has AVX512-VNNI or AVX2 (`projection`), else torch's."""

    max_rows = INT4_MAX_ROWS

    def __init__(self, q: torch.Tensor, step: torch.Tensor, low: torch.Tensor, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.projection = None
        module = kernels.load()
        if module is not None and module.has_low_bit() and q.shape[0] % 16 == 0 and q.shape[1] % GROUP == 0:
            self.projection = module.Projection.int4(q, step.float().contiguous(), low.float().contiguous())
            self.max_rows = OUR_MAX_ROWS
            return
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8)  # (N, K/2) uint8
        # the kernel's (K/32, N, 2): scale and zero, with weight = (q - 8) * scale + zero
        self.scales_and_zeros = torch.stack((step, low + 8 * step), -1).transpose(0, 1).contiguous().to(dtype)

    @staticmethod
    def wanted(weight: torch.Tensor, dtype: torch.dtype) -> bool:
        """bfloat16 activations on a CPU with a kernel; float32 models stay exact and untouched."""
        return dtype == torch.bfloat16 and weight.device.type == "cpu" and (KERNEL_AVAILABLE or kernels.has_low_bit())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # (N, in) -> (N, out)
        if self.projection is not None:
            return self.projection.matmul(x.contiguous())
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_and_zeros)

    def nbytes(self) -> int:
        if self.projection is not None:
            return self.projection.nbytes
        return self.packed.numel() + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size()
