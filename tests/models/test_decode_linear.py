"""Decode copies of projections: an exactly-4-bit weight's grid is found (or declined) exactly; the int4 or
int8 copy computes what the float weight does, at decode sizes only; nothing of it is saved."""

import pytest
import torch
import torch.nn.functional as F

from runtime.layers import int4
from runtime import kernels
from runtime.layers.decode_linear import INT8_MAX_ROWS, DecodeLinear, Int8DecodeWeight
from runtime.layers import decode_linear
from runtime.layers.int4 import AMX_MAX_ROWS, EVERY_ROW, GROUP, INT4_MAX_ROWS, OUR_MAX_ROWS, Int4Weight, int4_grid
from runtime.layers.int8_blocks import int8_block_grid
from runtime.layers.linear import PackedWeight
from runtime.layers.quantized import kernel_path_only
from runtime.memory_bound import decode_weight_bytes
from runtime.models.config import Gemma3Config
from runtime.models.loader import build_model, random_state_dict

needs_kernel = pytest.mark.skipif(not int4.KERNEL_AVAILABLE and not kernels.has_low_bit(), reason="no CPU int4 kernel here")


def q4k_like(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """float32 values as a GGUF Q4_K tensor dequantises: `s * q - m` per group of 32, q in 0..15, some groups
    using only part of the range, one constant."""
    gen = torch.Generator().manual_seed(seed)
    groups = cols // GROUP
    q = torch.randint(0, 16, (rows, groups, GROUP), generator=gen)
    q[0, 0] = torch.randint(3, 9, (GROUP,), generator=gen)  # levels 3..8 only
    q[1, 1] = 7  # a constant group
    s = torch.rand(rows, groups, 1, generator=gen) * 0.01 + 1e-4
    m = s * (7.5 + torch.randn(rows, groups, 1, generator=gen))  # groups roughly centred on 0, as trained weights
    return (s * q.float() - m).reshape(rows, cols)


def test_a_4bit_weight_is_recovered_exactly():
    w = q4k_like(24, 128)
    q, step, low = int4_grid(w)
    assert q.dtype == torch.int32 and int(q.min()) >= 0 and int(q.max()) <= 15
    back = low.repeat_interleave(GROUP, 1) + step.repeat_interleave(GROUP, 1) * q
    assert bool(((back - w).abs() <= 1e-4 * step.repeat_interleave(GROUP, 1) + 1e-9).all())  # float32 rounding only
    assert step[1, 1] == 0 and int((step > 0).sum()) == step.numel() - 1  # the constant group alone: step 0


def symmetric_blocks_like(rows: int, cols: int, top: int, seed: int = 0) -> torch.Tensor:
    """float32 values as a GGUF Q5_0 (top -16: n in -16..15) or Q8_0 (top 127: n in -127..127) tensor dequantises:
    `d * n` per block of 32, d a float16, the block's largest magnitude at `top`."""
    gen = torch.Generator().manual_seed(seed)
    n = torch.randint(-abs(top) + 1, abs(top), (rows, cols // 32, 32), generator=gen)
    n[:, :, 0] = top
    d = (torch.rand(rows, cols // 32, 1, generator=gen) / 100).half().float()
    return (d * n).reshape(rows, cols)


def test_an_int8_block_weight_is_recovered_exactly():
    for w in (symmetric_blocks_like(32, 128, -16), symmetric_blocks_like(32, 128, 127)):  # Q5_0, Q8_0
        w[3, :32] = 0  # an all-zero block
        q, scales = int8_block_grid(w)
        assert q.dtype == torch.int8 and scales.shape == (32, 4)
        assert torch.equal(q.float() * scales.repeat_interleave(32, 1), w)
        assert scales[3, 0] == 0
    assert int8_block_grid(torch.randn(32, 128)) is None
    assert int8_block_grid(q4k_like(32, 128)) is None  # asymmetric levels: not one scale times integers
    assert int8_block_grid(torch.randint(-127, 128, (32, 128)) * 0.003) is None  # integers, but 0.003 is no float16


@needs_kernel
def test_a_q5_0_weight_gets_an_exact_int8_copy():
    if not kernels.has_low_bit():
        pytest.skip("per-block int8 scales are our kernels' (AVX512-VNNI or AVX2)")
    w = symmetric_blocks_like(96, 128, -16)
    layer = DecodeLinear(128, 96).to(torch.bfloat16)
    layer.load_state_dict({"weight": w})
    assert layer.decode.projection.format == "int8-block" and "per block (exact)" in repr(layer)
    x = torch.randn(5, 128).bfloat16()
    with torch.no_grad():
        got = layer(x).float()
    ref = x.float() @ w.T
    assert (got - ref).norm() / ref.norm() < 0.02  # the activations' int8 blocks and the output's bfloat16 only


@pytest.mark.parametrize("weight", [
    torch.randn(24, 128),  # float weights
    torch.randint(-16, 16, (24, 128)).float() * 0.01,  # 32 levels (Q5_0-like)
    torch.randn(24, 100),  # columns not a multiple of the group
], ids=["float", "5bit", "ragged"])
def test_a_weight_that_is_not_4bit_is_declined(weight):
    assert int4_grid(weight) is None


@needs_kernel
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_the_decode_copy_computes_what_the_float_weight_does_at_decode_sizes_only(kind):
    torch.manual_seed(0)
    w = q4k_like(96, 128) if kind == "int4" else torch.randn(96, 128) * 0.05
    layer = DecodeLinear(128, 96).to(torch.bfloat16)
    layer.load_state_dict({"weight": w})
    assert isinstance(layer.decode, Int4Weight if kind == "int4" else Int8DecodeWeight) and kind in repr(layer)
    ours = layer.decode.projection is not None  # our kernels (AVX512-VNNI or AVX2): every row count but with AMX
    assert ours == (kernels.load() is not None and kernels.load().has_low_bit())
    assert layer.decode.max_rows == (OUR_MAX_ROWS if ours else INT4_MAX_ROWS if kind == "int4" else INT8_MAX_ROWS)
    every = layer.decode.max_rows >= EVERY_ROW
    assert (layer.packed is None) == (every or not PackedWeight.wanted(layer.weight))  # no pack beside such a copy
    assert list(layer.state_dict()) == ["weight"]  # derived, never saved
    for rows in (1, 8, 600):
        x = torch.randn(rows, 128).bfloat16()
        with torch.no_grad():
            got, dense = layer(x), F.linear(x, w.bfloat16())
        ref = F.linear(x.float(), w)
        if rows > layer.decode.max_rows:  # torch's kernels: more rows take the bfloat16 weight
            assert torch.equal(got, F.linear(x, layer.weight))
        elif kind == "int4" and not ours:
            # torch's kernel: as close as the bfloat16 weight gets (the scales' rounding against every weight's)
            assert (got.float() - ref).abs().max() <= 2 * (dense.float() - ref).abs().max()
        else:  # per-channel int8: half a step of 1/127 of a row's largest weight; our kernels: int8 activation
            # blocks (tests/kernels holds their exact arithmetic)
            torch.testing.assert_close(got.float(), ref, rtol=0.05, atol=0.05)
    x = torch.randn(9, 128).bfloat16()
    with torch.no_grad(), kernel_path_only():
        # the quality benchmark's decode path: eight rows at a time, as decode steps run them
        assert torch.equal(layer(x), torch.cat([layer.decode.matmul(x[:8]), layer.decode.matmul(x[8:])]))


def test_with_amx_our_copies_serve_decode_batches_and_the_weight_keeps_its_pack(monkeypatch):
    """Where the CPU has AMX (oneDNN's bfloat16 tiles), prefill keeps the prepacked weight and decode batches up to
    AMX_MAX_ROWS take the copy: simulated here by the row limit that detection sets there."""
    if not kernels.has_low_bit():
        pytest.skip("our kernels need AVX512-VNNI or AVX2")
    monkeypatch.setattr(decode_linear, "OUR_MAX_ROWS", AMX_MAX_ROWS)
    w = torch.randn(96, 128) * 0.05
    layer = DecodeLinear(128, 96).to(torch.bfloat16)
    layer.load_state_dict({"weight": w})
    assert layer.decode.projection is not None and layer.decode.max_rows == AMX_MAX_ROWS
    assert f"up to {AMX_MAX_ROWS} rows" in repr(layer)
    assert (layer.packed is not None) == PackedWeight.wanted(layer.weight)
    x = torch.randn(AMX_MAX_ROWS + 1, 128).bfloat16()
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight))  # prefill's rows: the bfloat16 weight
        for rows in (8, 16, AMX_MAX_ROWS):  # decode batches' (streamed, then in tiles): the copy
            assert torch.equal(layer(x[:rows]), layer.decode.matmul(x[:rows]))
            assert not torch.equal(layer(x[:rows]), F.linear(x[:rows], layer.weight))


@needs_kernel
def test_the_memory_floor_counts_the_decode_copies_bytes():
    config = Gemma3Config.tiny()
    state = random_state_dict(config, seed=0)
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    state[o_proj] = q4k_like(*state[o_proj].shape)
    plain = build_model(config, state, torch.bfloat16, quantization="int8-head")
    layer = plain.model.layers[0].self_attn.o_proj
    assert isinstance(layer.decode, Int4Weight)
    assert isinstance(plain.model.layers[0].self_attn.qkv_proj.decode, Int8DecodeWeight)
    with_copy = decode_weight_bytes(plain, 1)
    saved = layer.weight.numel() * 2 - layer.decode.nbytes()
    layer.decode = None
    assert with_copy == decode_weight_bytes(plain, 1) - saved


def test_a_weight_quantised_per_block_of_128_is_within_half_a_step():
    w = torch.randn(32, 256) * torch.logspace(-3, 0, 256)  # blocks of very different magnitudes
    w[5, 128:] = 0  # an all-zero block
    q, scales = decode_linear.quantize_per_block(w, 128)
    assert q.dtype == torch.int8 and scales.shape == (32, 2) and int(q.abs().max()) == 127
    step = scales.repeat_interleave(128, 1)
    assert bool(((q.float() * step - w).abs() <= step / 2 + 1e-9).all())
    assert bool((q[5, 128:] == 0).all())


def test_a_weight_quantised_within_a_pair_budget_keeps_every_four_within_it():
    """`pair_budget`: the fours of a row that one 16-bit sum of the AVX2 tiles holds (8i + {0, 1, 4, 5}, 8i + {2, 3,
    6, 7}) add up to at most the budget once rounded, by a larger scale only where a four needs it; half a step."""
    torch.manual_seed(0)
    w = torch.randn(32, 256)
    w[3, :8] = torch.tensor([9.0, 9.0, 0.1, 0.1, 9.0, 9.0, 0.1, 0.1])  # one four near the block's largest value
    plain, plain_scales = decode_linear.quantize_per_block(w, 128)
    q, scales = decode_linear.quantize_per_block(w, 128, pair_budget=258)
    assert int(decode_linear.pair_quads(plain[3:4].int().abs())[0, 0]) > 258  # 4 x 127: too much for 16 bits
    assert int(decode_linear.pair_quads(q.int().abs()).max()) <= 258
    assert float(scales[3, 0]) > float(plain_scales[3, 0]) * 1.8  # that block's scale raised
    ratio = scales / plain_scales
    assert float(ratio.min()) >= 1.0 and float((ratio == 1).float().mean()) > 0.2  # others as before, or a little up
    step = scales.repeat_interleave(128, 1)
    assert bool(((q.float() * step - w).abs() <= step / 2 + 1e-6).all())
    quads = decode_linear.pair_quads(torch.arange(16.0).view(1, 16))  # 0+1+4+5, 2+3+6+7, 8+9+12+13, 10+11+14+15
    assert torch.equal(quads, torch.tensor([[10.0, 18.0, 42.0, 50.0]]))


def _vnni_without_amx():
    if not kernels.has_low_bit():
        pytest.skip("the tiles' copies are our kernels' (AVX512-VNNI or AVX2)")
    if OUR_MAX_ROWS < EVERY_ROW:
        pytest.skip("with AMX prefill keeps oneDNN's bfloat16 weight: no tiles' copies")


def _relative_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return float((out.float() - exact).norm() / exact.norm())


@needs_kernel
@pytest.mark.parametrize("kind", ["int4", "q5_0", "q8_0", "int8"])
def test_a_copy_for_every_row_count_runs_the_rows_past_eight_on_int8_in_blocks_of_128(kind):
    """Except, on AVX2, a copy whose own blocks its tiles sum faster (int4, or Q5_0's values: `own_blocks_faster`):
    that one keeps the GGUF's blocks for every row count and keeps no values for a tiles' copy."""
    _vnni_without_amx()
    torch.manual_seed(0)
    w = {"int4": q4k_like(96, 256), "q5_0": symmetric_blocks_like(96, 256, -16),
         "q8_0": symmetric_blocks_like(96, 256, 127), "int8": torch.randn(96, 256) * 0.05}[kind]
    layer = DecodeLinear(256, 96).to(torch.bfloat16)
    layer.load_state_dict({"weight": w})
    projection = layer.decode.projection
    assert projection.format == {"int4": "int4", "int8": "int8"}.get(kind, "int8-block")
    assert projection.narrow == (kind == "q5_0")
    x = torch.randn(40, 256).bfloat16()
    own = kind in ("int4", "q5_0") and kernels.load().low_bit_isa() == "avx2"
    assert decode_linear.own_blocks_faster(projection) == own
    if own:
        assert layer.tiles_source is None and not projection.has_tiles
        with torch.no_grad():
            assert torch.equal(layer(x), projection.matmul(x))  # every row count on the GGUF's own blocks
            assert _relative_error(layer(x), x.float() @ w.T) < 0.02
        return
    assert torch.equal(layer.tiles_source, w) and not projection.has_tiles  # kept until made
    with torch.no_grad():
        gguf = layer(x)
        decode_linear.make_tiles(layer, None)
        assert layer.tiles_source is None and layer.decode.projection.has_tiles
        tiles = kernels.load().Projection.int8_wide(
            *decode_linear.quantize_per_block(w, 128, decode_linear.tile_pair_budget()))
        assert tiles.paired or decode_linear.tile_pair_budget() is None  # on AVX2: two lines a step
        assert torch.equal(layer(x), tiles.matmul(x)) and not torch.equal(layer(x), gguf)  # past eight rows
        assert torch.equal(layer(x[:8]), gguf[:8])  # up to eight: the GGUF's own blocks
        assert _relative_error(layer(x), x.float() @ w.T) < 0.02
    with pytest.raises(ValueError, match="kept no values"):
        decode_linear.make_tiles(layer, None)  # made already
    short = DecodeLinear(96, 32).to(torch.bfloat16)  # 96 values a row: no whole block of 128
    short.load_state_dict({"weight": torch.randn(32, 96) * 0.05})
    assert short.decode.projection is not None and short.tiles_source is None


@needs_kernel
def test_a_smoothed_copy_divides_the_activation_columns_and_keeps_a_loud_column_from_flattening_its_block():
    _vnni_without_amx()
    torch.manual_seed(0)
    w = torch.randn(96, 256) * 0.05
    x = torch.randn(40, 256)
    x[:, 7] *= 60  # one column far louder than its block's others, as Gemma's are
    x = x.bfloat16()
    exact = x.float() @ w.T
    errors = {}
    for smooth in (False, True):
        layer = DecodeLinear(256, 96).to(torch.bfloat16)
        layer.load_state_dict({"weight": w})
        column_max = x.float().abs().amax(0)
        decode_linear.make_tiles(layer, column_max if smooth else None)
        assert layer.decode.projection.smoothed == smooth
        with torch.no_grad():
            errors[smooth] = float((layer(x).float() - exact).abs().mean())
            if smooth:  # what the kernel computes: the weight's columns times s quantised, the rows divided by s
                s = decode_linear.smoothing(column_max, w)
                tiles = kernels.load().Projection.int8_wide(
                    *decode_linear.quantize_per_block(w * s, 128, decode_linear.tile_pair_budget()), s)
                assert torch.equal(layer(x), tiles.matmul(x))
    assert errors[True] < 0.6 * errors[False], errors


def test_smoothing_moves_half_the_range_and_floors_quiet_columns():
    a = torch.tensor([4.0, 1.0, 1.0, 1.0, 0.0])
    w = torch.ones(3, 5) * torch.tensor([1.0, 1.0, 4.0, 1.0, 1.0])
    s = decode_linear.smoothing(a, w, alpha=0.5)
    # sqrt(a / w): a loud activation column gets a divisor above one, a loud weight column below; the silent
    # column's maximum is taken as a tenth of the median column's (1.0), not as zero
    torch.testing.assert_close(s, torch.tensor([2.0, 1.0, 0.5, 1.0, 0.1 ** 0.5]))


@needs_kernel
def test_prefill_weights_gguf_drops_the_tiles_copies_and_remakes_what_holds_them():
    _vnni_without_amx()
    model = torch.nn.Sequential(DecodeLinear(256, 96), DecodeLinear(256, 32)).to(torch.bfloat16)
    for layer in model:
        layer.load_state_dict({"weight": torch.randn(layer.out_features, 256) * 0.05})
    assert decode_linear.set_prefill_weights(model, tiles=True) == 0  # none made yet
    for layer in model:
        decode_linear.make_tiles(layer, None)
    assert decode_linear.set_prefill_weights(model, tiles=True) == 2
    before = DecodeLinear.copies_set
    x = torch.randn(20, 256).bfloat16()
    with torch.no_grad():
        tiled = model[0](x)
        assert decode_linear.set_prefill_weights(model, tiles=False) == 0
        assert DecodeLinear.copies_set == before + 2  # a decode stack made before would be remade
        assert not any(layer.decode.projection.has_tiles for layer in model)
        assert not torch.equal(model[0](x), tiled)  # the GGUF's own blocks now
        assert torch.equal(model[0](x), model[0].decode.projection.matmul(x))


@needs_kernel
def test_gguf_releases_the_values_kept_for_tiles_without_making_them():
    _vnni_without_amx()
    layer = DecodeLinear(256, 96).to(torch.bfloat16)
    layer.load_state_dict({"weight": torch.randn(96, 256) * 0.05})
    assert layer.tiles_source is not None
    assert decode_linear.set_prefill_weights(torch.nn.Sequential(layer), tiles=False) == 0
    assert layer.tiles_source is None and not layer.decode.projection.has_tiles
