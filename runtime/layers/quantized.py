"""Weight-only int8 layers on torch's own kernel, `aten::_weight_int8pack_mm`.

Each output channel (a row of the (out, in) weight, a token's row of the embedding table) is stored as int8
with one symmetric scale, `w ≈ q * scale`, `scale = max|w_row| / 127`. Decode, which reads every weight once
per step for a few rows of activations, is bound by the bytes it reads: a quarter of float32's.

Two paths, chosen by the number of rows:
- Fewer than `DEQUANT_MIN_ROWS` (decode): the int8 kernel, its activations rounded to bfloat16 whatever the
  model's dtype (the output comes back in it). On CPU the kernel is vectorised for 16-bit activations only:
  with float32 inputs it ran 2-10x slower than a float32 matmul on an AVX2 core, with bfloat16 inputs 1.5-4x
  faster (a 4096 x 640 weight, 1 to 32 rows).
- More (prefill): the weight dequantised on the fly and a dense matmul, faster there than the kernel, whose
  cost grows with the rows faster than a GEMM's (at 256 rows: 20 ms against 33 ms). The dense matmul runs in
  bfloat16 when the activations are bfloat16 and the CPU has bfloat16 units (AVX512-BF16 or AMX: 2-3x a
  float32 GEMM at prefill sizes), else in float32 (see `runtime/layers/linear.py`).

Quantisation happens while a checkpoint is loaded: a `weight` entry of the state dict (float, of any
precision; the loader hands float32) is replaced by `weight_int8` and `scales` (float32) before the module
reads it, so a model is built directly in its quantised form and never holds its float weights.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.linear import CPU_HAS_BF16_UNITS

INT8_MAX = 127
KERNEL_DTYPE = torch.bfloat16  # activations and scales as the int8 kernel takes them
DEQUANT_MIN_ROWS = 128
_dequant_min_rows = DEQUANT_MIN_ROWS


@contextmanager
def kernel_path_only() -> Iterator[None]:
    """Every int8 matmul through the kernel, whatever its row count, while inside: scores a whole text in
    one forward with decode's arithmetic (quality measurements). Not thread-safe; not for serving."""
    global _dequant_min_rows
    previous, _dequant_min_rows = _dequant_min_rows, 2**62
    try:
        yield
    finally:
        _dequant_min_rows = previous


def _dense_in_own_dtype(x: torch.Tensor) -> bool:
    """Whether a dense matmul in x's dtype is fast: always but for bfloat16 on a CPU without bfloat16 units."""
    return x.dtype != torch.bfloat16 or x.device.type != "cpu" or CPU_HAS_BF16_UNITS


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) float -> (int8 (rows, cols), float32 scales (rows,)), symmetric, round to nearest."""
    w = weight.float()
    scales = w.abs().amax(dim=1) / INT8_MAX  # (rows,)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row: any scale, q = 0
    q = torch.round(w / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


class _Int8Rows(nn.Module):
    """Shared by the int8 layers: `weight_int8` (rows, cols) and float32 `scales` (rows,), filled from a float
    `weight` entry of the state dict at load time, and the scales in the kernel's dtype derived from them."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.register_buffer("weight_int8", torch.zeros(rows, cols, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(rows, dtype=torch.float32))
        self.register_buffer("kernel_scales", torch.ones(rows, dtype=KERNEL_DTYPE), persistent=False)
        self.register_load_state_dict_pre_hook(_quantize_on_load)
        self.register_load_state_dict_post_hook(_derive_kernel_scales)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:  # (..., cols) -> (..., rows)
        x2 = x.reshape(-1, x.shape[-1])  # (N, cols)
        if x2.shape[0] >= _dequant_min_rows:
            dense = x2.dtype if _dense_in_own_dtype(x2) else torch.float32
            out = F.linear(x2.to(dense), self.weight_int8.to(dense) * self.scales.to(dense)[:, None])
        else:
            out = torch.ops.aten._weight_int8pack_mm(x2.to(KERNEL_DTYPE), self.weight_int8, self.kernel_scales)
        return out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)


def _quantize_on_load(module: _Int8Rows, state_dict: dict, prefix: str, *args) -> None:
    weight = state_dict.pop(prefix + "weight", None)
    if weight is not None:
        state_dict[prefix + "weight_int8"], state_dict[prefix + "scales"] = quantize_per_channel(weight)


def _derive_kernel_scales(module: _Int8Rows, incompatible_keys) -> None:
    module.kernel_scales.copy_(module.scales)


class Int8Linear(_Int8Rows):
    """`y = x @ (q * scale)^T` without bias, the int8 counterpart of `runtime.layers.linear.Linear`."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(out_features, in_features)
        self.in_features = in_features
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return self._matmul(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


class Int8Embedding(_Int8Rows):
    """An int8 token table: lookups dequantise their rows; as a tied LM head (`attend`) it is one int8
    matmul over the whole table, the largest weight of a small model."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.out_dtype = torch.get_default_dtype()  # the model's dtype, as float layers take it

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, dim)
        return (self.weight_int8[ids].float() * self.scales[ids, None]).to(self.out_dtype)

    def attend(self, x: torch.Tensor) -> torch.Tensor:  # (..., dim) -> (..., num_embeddings)
        return self._matmul(x)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 per-row"
