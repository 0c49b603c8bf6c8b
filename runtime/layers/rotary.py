"""Rotary position embedding (rotate-half layout) with a precomputed float32 cos/sin table.

Gemma 3 uses two bases: 10 000 on sliding-window layers and 1 000 000 on global layers (whose positions
may also be linearly scaled). The model builds one `RotaryEmbedding` per distinct (base, factor), shares it
between the layers that use it, and looks the batch's angles up once per forward (`cos_sin`), not once per
layer, already laid out at full head width with the sign of the rotation folded into sin; each layer then
only rotates (`apply_rotary`: three multiply-adds' worth of operations instead of ten).
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.int_tensors import bounds


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: float, max_position: int, scaling_factor: float = 1.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.base = base
        self.max_position = max_position
        self.scaling_factor = scaling_factor
        # NOTE: explicit float32 everywhere: the model may be built under a bfloat16 default dtype, and
        # angles at positions in the thousands lose every digit that matters in bfloat16.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        inv_freq = 1.0 / (base**exponents) / scaling_factor  # (D/2,)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # (P, D/2)
        self.register_buffer("cos_cache", angles.cos(), persistent=False)  # (P, D/2)
        self.register_buffer("sin_cache", angles.sin(), persistent=False)  # (P, D/2)
        # The first rows of the tables as `cos_sin` returns them (full width, sin's sign folded in), grown on
        # demand: a decode step then gathers two rows instead of running seven small operations (~13 -> ~5 us
        # per table), and memory holds full width only up to the positions served, not all P.
        self.register_buffer("cos_wide", torch.empty(0, 1, head_dim, dtype=torch.float32), persistent=False)
        self.register_buffer("sin_wide", torch.empty(0, 1, head_dim, dtype=torch.float32), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The angles of the tokens at `positions` (T,) as `apply_rotary` takes them, each (T, 1, D) float32:
        cos of frequency i at i and i + D/2, and sin negated in the first half (`rotate_half`'s sign)."""
        tables = self.wide(positions)
        if tables is not None:
            cos_wide, sin_wide = tables
            return cos_wide[positions], sin_wide[positions]  # (T, 1, D)
        cos, sin = self.cos_cache[positions], self.sin_cache[positions]  # (T, D/2)
        return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)

    def wide(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The full-width tables (P', 1, D), widened to hold `positions` (T,): `cos_sin` gathers their rows, the
        fused decode stack reads them itself. None where they cannot serve: positions on a device (reading
        their range would cost a sync), none, or one outside [0, max_position)."""
        if not positions.is_cpu or not positions.numel():
            return None
        lo, hi = bounds(positions)
        if lo < 0 or hi >= self.max_position:
            return None
        if hi >= self.cos_wide.shape[0]:
            return self._widen(hi + 1)
        return self.cos_wide, self.sin_wide

    def _widen(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-width tables of at least `rows` rows (doubling, so that growth is rare)."""
        rows = min(self.max_position, max(rows, 2 * self.cos_wide.shape[0], 1024))
        cos, sin = self.cos_cache[:rows], self.sin_cache[:rows]
        self.cos_wide = torch.cat((cos, cos), -1).unsqueeze(1)  # (rows, 1, D): a gather gives cos_sin's shape
        self.sin_wide = torch.cat((-sin, sin), -1).unsqueeze(1)
        return self.cos_wide, self.sin_wide

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q (T, H, D) and k (T, Hkv, D) by their tokens' positions (T,)."""
        cos, sin = self.cos_sin(positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, base={self.base:g}, max_position={self.max_position}, "
            f"scaling_factor={self.scaling_factor:g}"
        )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, heads, D) by angles (T, 1, D) from `cos_sin`: pairs (x[i], x[i + D/2]) turn by the angle
    of frequency i; computed in float32, returned in x's dtype. `x * cos + roll(x) * sin` is the reference's
    `x * cos + rotate_half(x) * sin` bit for bit: roll gives (x2, x1), and x2 * (-sin) == (-x2) * sin."""
    x32 = x.float()
    return (x32 * cos + x32.roll(x.shape[-1] // 2, -1) * sin).to(x.dtype)  # (T, H, D)
