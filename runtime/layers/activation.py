"""The gated activation of Gemma's MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GELU (tanh approximation) of the gate times the up projection; shapes (..., I) -> (..., I)."""
    return F.gelu(gate, approximate="tanh") * up


class GeluTanhAndMul(nn.Module):
    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul(gate, up)
