"""bfloat16 projections through oneDNN's prepacked weights: bit-identical to `F.linear`, re-packed whenever
a checkpoint is loaded, and never used where they do not apply (float32, gradients, CPUs without bfloat16
units)."""

import pytest
import torch
import torch.nn.functional as F

from runtime.layers import linear as linear_module
from runtime.layers.linear import Embedding, Linear, PackedWeight, bucketed_rows, packed_shapes, warm_row_counts

needs_packing = pytest.mark.skipif(not linear_module.PACKING, reason="this CPU has no bfloat16 units")


def _bf16_linear(out_features: int, in_features: int, seed: int) -> tuple[Linear, torch.Tensor]:
    torch.manual_seed(seed)
    weight = torch.randn(out_features, in_features).bfloat16()
    layer = Linear(in_features, out_features).bfloat16()
    layer.load_state_dict({"weight": weight})
    return layer, weight


@needs_packing
@pytest.mark.parametrize("rows", [1, 8, 37, 64, 65, 130, 600, 1000])  # past 64 padded to a multiple of 64
def test_packed_bf16_linear_is_bit_identical_to_f_linear_of_its_padded_rows(rows):
    layer, weight = _bf16_linear(384, 640, seed=rows)
    assert isinstance(layer.packed, PackedWeight)
    x = torch.randn(rows, 640).bfloat16()
    # padded with zero rows past 64: F.linear's rows of the padded input (oneDNN's sums of a row can depend on the
    # row count, e.g. 130 rows against 192, by a rounding)
    padded = torch.cat((x, x.new_zeros(bucketed_rows(rows) - rows, 640)))
    with torch.no_grad():
        out = layer(x)
        assert out.shape == (rows, 384) and out.is_contiguous()
        assert torch.equal(out, F.linear(padded, weight)[:rows])


def test_row_counts_past_a_bucket_are_padded_to_a_multiple_of_it():
    assert [bucketed_rows(r) for r in (1, 63, 64, 65, 128, 129, 600, 2048)] == [1, 63, 64, 128, 128, 192, 640, 2048]


@needs_packing
def test_start_up_multiplies_each_distinct_packed_shape_at_every_padded_row_count(monkeypatch):
    """So that no request pays for oneDNN's primitive of a new row count: every count a prefill of up to 200 rows pads
    to, once per weight shape (two layers of one shape count once)."""
    model = torch.nn.Sequential(*(_bf16_linear(n, 64, seed)[0] for seed, n in enumerate((96, 96, 32))))
    weights = packed_shapes(model)
    assert sorted(p.tensor.shape[0] for p in weights) == [32, 96]
    seen = []
    multiply = PackedWeight.matmul

    def spy(self, x):
        seen.append((self.tensor.shape[0], x.shape[0]))
        return multiply(self, x)

    monkeypatch.setattr(PackedWeight, "matmul", spy)
    warm_row_counts(weights, 200)
    assert sorted(seen) == [(n, rows) for n in (32, 96) for rows in (64, 128, 192, 256)]


@needs_packing
def test_loading_again_repacks_the_new_weight():
    layer, _ = _bf16_linear(96, 64, seed=0)
    first = layer.packed
    other = torch.randn(96, 64).bfloat16()
    layer.load_state_dict({"weight": other})
    assert layer.packed is not first
    x = torch.randn(4, 64).bfloat16()
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, other))


@needs_packing
def test_tied_head_projects_through_the_pack_and_looks_up_the_plain_table():
    torch.manual_seed(1)
    table = torch.randn(1000, 64).bfloat16()
    emb = Embedding(1000, 64).bfloat16()
    emb.load_state_dict({"weight": table})
    assert emb.packed is not None
    x = torch.randn(3, 64).bfloat16()
    with torch.no_grad():
        assert torch.equal(emb.attend(x), F.linear(x, table))
        assert torch.equal(emb(torch.tensor([0, 999, 5])), table[[0, 999, 5]])


def test_float32_and_gradients_take_the_plain_path():
    torch.manual_seed(2)
    layer = Linear(64, 32)
    layer.load_state_dict({"weight": torch.randn(32, 64)})
    assert layer.packed is None  # float32 stays on the kernel transformers uses (token-exact oracle)
    if linear_module.PACKING:
        bf = Linear(64, 32).bfloat16()
        bf.load_state_dict({"weight": torch.randn(32, 64).bfloat16()})
        x = torch.randn(2, 64).bfloat16().requires_grad_()
        out = bf(x)  # grad enabled: the pack is not differentiable, F.linear is
        out.sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape


@needs_packing
def test_code_being_compiled_takes_the_plain_path():
    """`--compile-decode` compiles the layers' math: torch's compiler cannot lower the prepacked op, so a
    packed layer must fall back to its weight there (it crashed the compile before)."""
    layer, weight = _bf16_linear(96, 64, seed=3)
    compiled = torch.compile(layer, dynamic=True)
    x = torch.randn(5, 64).bfloat16()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), F.linear(x, weight), rtol=1e-2, atol=1e-2)
