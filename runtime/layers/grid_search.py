"""The step of an evenly spaced grid that holds a group's values exactly: what `int4_grid` and
`int8_block_grid` look for in a dequantised GGUF tensor. In torch operations: the path where the fused kernels are
not built; with them, `runtime/kernels/grids.cpp` finds the same grids in one pass (a 2-core Xeon: 3.3 s of
start-up here, ~0.1 s there)."""

from __future__ import annotations

import torch


def grid_steps(offsets: torch.Tensor, span: torch.Tensor, units: tuple[int, ...] | range,
               tolerance: float, float16_steps: bool = False) -> torch.Tensor | None:
    """Per group (a row of `offsets`, (G, n)), a step such that every offset is a whole number of steps, tried as
    `span / k` for k in `units` in order (with `float16_steps`, only steps that are float16 values); 0 where the
    span is 0. None if some group fits no k. Each pass looks only at the groups no earlier k held."""
    step = torch.zeros_like(span)
    todo = (span > 0).nonzero().squeeze(1)
    for k in units:
        trial = span[todo] / k
        t = offsets[todo] / trial[:, None]
        fits = ((t - t.round()).abs() <= tolerance).all(-1)
        if float16_steps:
            fits &= trial.half().float() == trial
        step[todo[fits]] = trial[fits]
        todo = todo[~fits]
        if not todo.numel():
            break
    return None if todo.numel() else step
