"""Weight-holding layers that skip random initialisation: their weights always come from a checkpoint.

`nn.Linear` and `nn.Embedding` initialise every weight randomly on construction, which for a 270M-parameter
model costs seconds and a second copy of memory before the checkpoint overwrites it all.

bfloat16 matmuls need bfloat16 units (AVX512-BF16 or AMX) to be fast on a CPU; without them torch runs them
through an emulation that is slower than float32 as soon as more than a few rows go through at once (a
4096 x 640 weight at 64 rows: 36 ms against 6 ms in float32 on an AVX2 core). There, `linear` computes
bfloat16 inputs of `UPCAST_MIN_ROWS` rows or more (prefill) in float32, which is what a bfloat16 unit does
too (float32 accumulation, one rounding of the result), at the cost of converting the weight on the fly
(which only pays from ~16-32 rows on: below that it costs more than the emulation). Decode steps of a few
rows stay in bfloat16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

UPCAST_MIN_ROWS = 32
CPU_HAS_BF16_UNITS = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight^T`; see the module docstring for bfloat16 on CPUs without bfloat16 units."""
    if (x.dtype == torch.bfloat16 and not CPU_HAS_BF16_UNITS and x.device.type == "cpu"
            and x.numel() >= UPCAST_MIN_ROWS * x.shape[-1]):
        return F.linear(x.float(), weight.float()).to(x.dtype)
    return F.linear(x, weight)


class Linear(nn.Module):
    """`y = x @ W^T` without bias; W is (out_features, in_features), uninitialised until loaded."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Embedding(nn.Module):
    """Token embedding table (num_embeddings, dim), uninitialised until loaded."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, dim)
        return F.embedding(ids, self.weight)

    def attend(self, x: torch.Tensor) -> torch.Tensor:  # (..., dim) -> (..., num_embeddings)
        """The table as an output projection (a tied LM head): scores of `x` against every row."""
        return linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"
