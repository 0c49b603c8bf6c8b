"""Gemma's RMSNorm: the weight is stored zero-centred and applied as `1 + w`.

The normalisation runs as one `torch.rms_norm` call (aten's composite: the reference's pow, mean, add, rsqrt
and multiplications, in that order, so float32 results are bit-identical) instead of six Python-level
operations: a decode step normalises about 90 times, and at batch 1 each operation's dispatch costs about as
much as its arithmetic.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime import kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x * rsqrt(mean(x^2) + eps) * (1 + weight)` over the last dimension, in float32, cast back to x's dtype.

    `weight` broadcasts against x (e.g. (dim,), or (heads, dim) to normalise several heads with their own
    weights in one pass). The operations and their order are the reference implementation's, so float32
    results are bit-identical to it.
    """
    return rms_norm_scaled(x, 1.0 + weight.float(), eps)


def rms_norm_scaled(x: torch.Tensor, scale: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    """`rms_norm` with its float32 multiplier `scale` = 1 + weight already made (see `RMSNorm.scale`): (dim,)
    goes into the one call, per-head multipliers (heads, dim) follow it. With `residual`, `residual + norm`
    (the norm rounded to x's dtype first). A bfloat16 x on the CPU takes the fused kernel (`runtime.kernels`):
    one pass, the same values but where float32 sums in another order move one across a rounding (rarely)."""
    fused = kernels.for_tensor(x)
    if fused is not None:
        return fused.rms_norm(x.contiguous(), scale, eps, None if residual is None else residual.contiguous())
    if residual is not None:
        return residual + rms_norm_scaled(x, scale, eps)
    x32 = x.float()
    if scale.dim() == 1:
        return torch.rms_norm(x32, scale.shape, scale, eps).to(x.dtype)
    return (torch.rms_norm(x32, scale.shape[-1:], None, eps) * scale).to(x.dtype)


class RMSNorm(nn.Module):
    """`y = x * rsqrt(mean(x^2) + eps) * (1 + w)`, computed in float32 and cast back to x's dtype.

    NOTE: the `1 + w` form is Gemma's (Hugging Face) parameterisation; ggml/GGUF files store `1 + w`
    itself, so the loader subtracts 1. Multiplying by `1 + w` before the downcast (rather than casting
    first, as Llama does) matches the reference implementation in bfloat16.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self._scale: torch.Tensor | None = None
        self._scale_of: tuple | None = None

    def scale(self) -> torch.Tensor:
        """`1 + w` in float32, made again only when the weight changed (another tensor, dtype or device, or an
        in-place write such as `load_state_dict`): a decode step normalises 90 times, and two operations saved
        each time are measurable at batch 1."""
        w = self.weight
        if torch.compiler.is_compiling():
            return 1.0 + w.float()
        try:
            version = w._version
        except RuntimeError:  # a weight made under inference_mode tracks no version: never cache it
            return 1.0 + w.float()
        of = (w.data_ptr(), version, w.dtype, w.device)
        if of != self._scale_of:
            with torch.no_grad():
                self._scale = 1.0 + w.float()
            self._scale_of = of
        return self._scale

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:  # (..., dim)
        """The norm of x, added to `residual` when given (one pass in the fused kernel)."""
        return rms_norm_scaled(x, self.scale(), self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
