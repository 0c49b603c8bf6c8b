"""Weights that are exactly int8 values times a float16 scale per block of 32: a GGUF file's Q5_0 and Q8_0 tensors.

Q8_0 stores each group of 32 consecutive weights of a row as `d * n`, n in -127..127; Q5_0 as `d * n`, n in
-16..15 (the value of largest magnitude at -16); d is a float16 either way. Dequantised to float32 by the loader,
such a weight is exactly int8 values with one float16 scale per block of 32, which the int8 kernels of
`runtime/kernels` multiply as they are (`Projection.int8` with per-block scales, 8.5 bits a weight): nothing
rounded, where re-quantising each row to one scale cost Gemma 3 270M two to three points of greedy agreement
with transformers (quality text, teacher-forced: 92.7% against 94.7% with the projections exact, 96.6% with
the LM head exact too). In its Q4_K_M file: `token_embd` (the tied LM head), every `attn_q`, `attn_k`,
`ffn_gate`, `ffn_up`, all of `attn_v`.
"""

from __future__ import annotations

import torch

from runtime import kernels
from runtime.layers.grid_search import grid_steps

BLOCK = 32
# Magnitudes the largest value of a block can have in units of its scale: Q8_0's 127, Q5_0's 16, then the rest
# (a block whose largest value came out smaller), tried in this order.
CANDIDATES = (127, 16, *range(126, 16, -1), *range(15, 0, -1))
TOLERANCE = 1e-3  # of a unit: float32 rounding of `d * n` and of the division, far below a unit
SAMPLE_ROWS = 8


def int8_block_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 (N, K), float32 scales (N, K/32)) with weight == q * scale per block of 32, or None if some block's
    values are not integer multiples of one float16 scale within -127..127. The first rows are tried alone first: most
    weights that are not on such a grid fail there, at a fraction of the cost. With the fused kernels built, in one
    pass (`runtime/kernels/grids.cpp`); else in torch operations, which find the same grid."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        return None
    weight = weight.float().contiguous()
    if weight.shape[0] > SAMPLE_ROWS and _grid(weight[:SAMPLE_ROWS]) is None:
        return None
    return _grid(weight)


def _grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    module = kernels.load()
    if module is not None:
        return module.int8_block_grid(weight, CANDIDATES, TOLERANCE)
    return grid_in_torch(weight)


def grid_in_torch(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`int8_block_grid` of a float32 (N, K) weight in torch operations."""
    N, K = weight.shape
    w = weight.reshape(-1, BLOCK)  # one block a row
    # an all-zero block: scale 0, values 0; a GGUF's scales are float16 values
    scale = grid_steps(w, w.abs().amax(-1), CANDIDATES, TOLERANCE, float16_steps=True)
    if scale is None:
        return None
    q = (w / torch.where(scale > 0, scale, 1.0)[:, None]).round().clamp_(-127, 127).to(torch.int8)
    return q.reshape(N, K), scale.reshape(N, K // BLOCK)
