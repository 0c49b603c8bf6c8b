"""The gated activation of Gemma's MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime import kernels


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GELU (tanh approximation) of the gate times the up projection; shapes (..., I) -> (..., I)."""
    return F.gelu(gate, approximate="tanh") * up


def gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`gelu_tanh_and_mul` of the two halves of (T, 2I) rows: one pass through the fused kernel for a bfloat16
    model on the CPU (`runtime.kernels`, the same roundings; 2048 rows of 2048 in ~0.3 against 2.3 ms)."""
    fused = kernels.for_tensor(gate_up)
    if fused is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
        return fused.gelu_and_mul(gate_up)
    return gelu_tanh_and_mul(*gate_up.chunk(2, dim=-1))
