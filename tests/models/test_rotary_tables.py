"""`cos_sin` reads full-width tables grown on demand; what it returns is what the half tables give."""

from __future__ import annotations

import pytest
import torch

from runtime.layers.rotary import RotaryEmbedding


def from_half_tables(rope: RotaryEmbedding, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rope.cos_cache[positions], rope.sin_cache[positions]
    return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)


def test_angles_equal_the_half_tables_bit_for_bit_as_the_tables_grow():
    rope = RotaryEmbedding(64, 10_000.0, 5000, 1.0)
    gen = torch.Generator().manual_seed(0)
    for top in (3, 900, 1500, 4999, 2500):  # grows at 1024-row steps and doubling, never beyond P
        positions = torch.randint(0, top + 1, (7,), generator=gen)
        positions[0] = top
        cos, sin = rope.cos_sin(positions)
        want_cos, want_sin = from_half_tables(rope, positions)
        assert cos.shape == (7, 1, 64) and torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
        assert top < rope.cos_wide.shape[0] <= 5000
    assert rope.cos_wide.shape[0] == 5000


def test_a_position_out_of_range_still_raises():
    rope = RotaryEmbedding(16, 10_000.0, 100, 1.0)
    with pytest.raises(IndexError):
        rope.cos_sin(torch.tensor([3, 100]))
