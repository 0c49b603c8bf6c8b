"""The gated activation of Gemma's MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GELU (tanh approximation) of the gate times the up projection; shapes (..., I) -> (..., I)."""
    return F.gelu(gate, approximate="tanh") * up
