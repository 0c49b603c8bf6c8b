"""A projection with a low-bit copy of its weight for decode's few rows (the `int8-head` format's projections).

A batch-1 decode step streams every weight once for one row of activations, so its projections cost what
their bytes cost; prefill, many rows at once, is compute-bound and keeps the prepacked bfloat16 weight
(`runtime/layers/linear.py`). `DecodeLinear` holds, next to it, a copy made at load time from the
checkpoint's own float32 values, and hands rows up to the copy's `max_rows` to it:

- exactly 4-bit weights (the GGUF's Q4_K tensors): an `Int4Weight`, the weight itself on our kernel where the
  CPU has AVX512-VNNI or AVX2, else with its per-group scales rounded on torch's (`runtime/layers/int4.py`);
- exactly int8 values times a scale per block of 32 (the GGUF's Q5_0 and Q8_0 tensors), where the CPU has
  AVX512-VNNI or AVX2: an `Int8DecodeWeight` with those scales, the weight itself (`runtime/layers/int8_blocks.py`);
- any other weight: per-channel int8 (`Int8DecodeWeight`), the rounding of the `int8` format
  (`runtime/layers/quantized.py`). Where the CPU has AVX512-VNNI or AVX2, on our kernel (`runtime/kernels`), which
  quantises the activations per block of 32 and reads the weights as several streams at once: 23-27 GB/s
  from memory against 11-12 for `aten::_weight_int8pack_mm` (the fallback), up to 8 rows; perplexity of the
  `int8-head` decode path +0.42% against float32.

Where a copy on our kernels takes every row count (AVX512-VNNI or AVX2, without AMX), it can also get a copy for the
rows past eight (prefill, decode batches past eight; `make_tiles`): int8 with a float32 scale per row and block of 128,
requantised from the same float32 values (kept at load as `tiles_source` until then), its activations quantised
per 128 too. Prefill is bound by the kernel's arithmetic, and a block's scaling takes the units its multiply-adds
need: a quarter of it made prefill's projections 1.2x (a 2-core Zen 4 EPYC), for about a byte a weight more memory.
A few of Gemma's activation columns are tens of times the others, and per 128 values one of them sets a block's
scale alone, so the copy is smoothed (`smoothing`): its columns times s, the activations divided by s as they are
quantised, s from the activations' range measured on a calibration text at start-up
(`runtime/models/calibration.py`). The prefill path's KL divergence from float32 on the fixed text: 0.0034
smoothed, 0.0063 not, 0.0046 on the GGUF's own blocks (docs/performance.md). `--prefill-weights gguf`
(`set_prefill_weights`) keeps the GGUF's blocks for every row count. On AVX2 the copy is quantised within a pair
budget (`tile_pair_budget`): each four weights whose products one 16-bit sum of the AVX2 tiles holds add up to at
most 258 in magnitude, so the tiles add two lines before widening, and prefill's projections ran 1.15-1.3x on a
Zen 1 EPYC, its KL from float32 unchanged (0.0032 against 0.0033 on the fixed text; weights within +-64 instead
doubled it). Also on AVX2, int4 copies and int8 ones of a GGUF's Q5_0 values (`narrow`) add more products in
16 bits before each widening than any tiles' copy there, and run faster: they keep their own blocks for every row
count (`own_blocks_faster`).

On the 2-core Xeon with AMX of this work (2 threads, quiet): a 4096 x 640 weight at one row took 255 against
355-365 us prepacked bfloat16 in int8, 100 against 329 us in int4 (a 4-bit weight); int8 stays ahead up to 4
rows and falls behind by 8, int4 up to 8. bfloat16 activations only: a float32 model keeps its exact path.
"""

from __future__ import annotations

import torch

from runtime import kernels
from runtime.layers.int4 import EVERY_ROW, OUR_MAX_ROWS, Int4Weight, int4_grid
from runtime.layers.int8_blocks import int8_block_grid
from runtime.layers.linear import Linear, linear

INT8_MAX_ROWS = 4
DECODE_ROWS = 8  # rows the streaming kernels take (the kernels' MAX_ROWS): past them, the tiles' arithmetic
_forced = False  # every row count through the copy, DECODE_ROWS at a time (`runtime.layers.quantized.kernel_path_only`)


def force_decode_copies(on: bool) -> bool:
    """Send every row count through the decode copies (quality scoring of the decode path); returns the
    previous setting. Not thread-safe; not for serving."""
    global _forced
    previous, _forced = _forced, on
    return previous


INT8_MAX = 127


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) float -> (int8 (rows, cols), float32 scales (rows,)), symmetric, round to nearest."""
    q, scales = quantize_per_block(weight, weight.shape[1])  # one block a row
    return q, scales[:, 0]


def quantize_per_block(weight: torch.Tensor, block: int, pair_budget: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) float -> (int8 (rows, cols), float32 scales (rows, cols / block)): symmetric, round to
    nearest, one scale per row and block of `block` values. With `pair_budget` (the kernels' `PAIR_BUDGET`), a
    block's scale is also large enough that each four values of a row which one 16-bit sum of the AVX2 tiles holds
    (8i + {0, 1, 4, 5} and 8i + {2, 3, 6, 7}) add up to at most the budget in magnitude once rounded (`pair_quads`)."""
    w = weight.float()
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // block, block)
    scales = blocks.abs().amax(dim=2) / INT8_MAX
    if pair_budget is not None:  # rounding adds less than 0.5 to each of the four: 2 of headroom
        quads = pair_quads(w.abs()).reshape(rows, cols // block, block // 4)
        scales = torch.maximum(scales, quads.amax(dim=2) / (pair_budget - 2))
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block: any scale, q = 0
    q = torch.round(blocks / scales[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.view(rows, cols), scales


def pair_quads(magnitudes: torch.Tensor) -> torch.Tensor:
    """(rows, cols) -> (rows, cols / 4): the sums of each row's values 8i + {0, 1, 4, 5} and 8i + {2, 3, 6, 7}, the
    four whose products one 16-bit lane of the AVX2 tiles adds (two lines of four values, pairs summed by
    `vpmaddubsw`: quant_avx2.h, `lines_in_16_bits`)."""
    rows, cols = magnitudes.shape
    return magnitudes.reshape(rows, cols // 8, 2, 2, 2).sum(dim=(2, 4)).reshape(rows, cols // 4)


class Int8DecodeWeight:
    """Per-channel int8 rows (symmetric, one scale a row, from `quantize_per_channel`). Where the fused CPU
    kernels have AVX512-VNNI or AVX2 (`runtime.kernels`), in their int8 kernel's layout (`projection`), which quantises
    the activations per block of 32 and reads the weights as four streams a thread: 23-27 against 11-12 GB/s
    for torch's `_weight_int8pack_mm` from memory (one row, 2 threads, on the Xeon of this work), up to 8 rows;
    else on that torch kernel, up to 4."""

    max_rows = INT8_MAX_ROWS

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        """`scales` (N,): one a row; (N, K/32): one per row and block of 32 (our kernels only)."""
        self.dtype = dtype
        self.projection = None
        module = kernels.load()
        if module is not None and module.has_low_bit() and q.shape[0] % 16 == 0 and q.shape[1] % 32 == 0:
            # every row count (up to 8 streamed, prefill's in tiles: 1.5x prepacked bfloat16 at 600 rows), but with
            # AMX decode batches' only (`runtime/layers/int4.py` OUR_MAX_ROWS)
            self.projection, self.max_rows = module.Projection.int8(q, scales.float().contiguous()), OUR_MAX_ROWS
        else:
            self.q, self.scales = q, scales.to(dtype)

    def matmul(self, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:  # (N, in) -> (N, out)
        if self.projection is None:
            out = torch.ops.aten._weight_int8pack_mm(x, self.q, self.scales)
            return out.float() if float_out else out
        return self.projection.matmul(x.contiguous(), float_out)

    def nbytes(self) -> int:
        if self.projection is not None:
            return self.projection.nbytes
        return self.q.numel() + self.scales.numel() * self.scales.element_size()


# Values per block of the tiles' copy (`make_tiles`): the rows past the streaming kernel's eight (prefill, decode
# batches past eight) run on int8 weights and activations quantised per 128 values instead of the GGUF's 32: the
# kernel scales its integer sums once per 128 values instead of four times, and those scalings took the issue
# ports the `vpdpbusd`s need (prefill's projections 1.2x on a Zen 4 EPYC; docs/performance.md).
WIDE_BLOCK = 128
# SmoothQuant's migration strength: the share of an activation column's range moved into the weight's column.
SMOOTH_ALPHA = 0.5
# A column's maxima are taken as at least this fraction of their median over the columns, so that a column quiet
# in calibration and loud later cannot get a divisor that blows its activations up past every other in its block.
SMOOTH_FLOOR = 0.1


def takes_tiles(copy: Int4Weight | Int8DecodeWeight | None, weight: torch.Tensor) -> bool:
    """Whether `copy` (made from `weight`) takes every row count on our kernels, and `weight`'s width divides into
    blocks of 128: then its rows past eight can run on a tiles' copy (`make_tiles`), unless its own blocks are
    faster there (`own_blocks_faster`)."""
    return (getattr(copy, "projection", None) is not None and copy.max_rows >= EVERY_ROW
            and weight.shape[1] % WIDE_BLOCK == 0 and not own_blocks_faster(copy.projection))


def own_blocks_faster(projection) -> bool:
    """On AVX2, an int4 copy adds a block's products in 16 bits before one widening multiply, and an int8 one whose
    values lie within +-NARROW_MAX (`narrow`: a GGUF's Q5_0) four lines' (quant_avx2.h, `lines_in_16_bits`). At 600
    rows on a Zen 1 EPYC: int4 1.32-1.34x the tiles' paired copy; Q5_0 1.12-1.14x it summed eight lines with signs,
    and 1.15-1.19x that as w + 16 over four (docs/performance.md). They are the GGUF's values exactly, so they keep
    their own blocks for every row count."""
    module = kernels.load()
    return (module is not None and module.low_bit_isa() == "avx2"
            and (projection.format in ("int4", "int4-half") or projection.narrow))


def smoothing(column_max: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTH_ALPHA) -> torch.Tensor:
    """(K,) divisors of a projection's input columns (SmoothQuant): a^alpha / w^(1 - alpha), a the activations'
    largest magnitude per column in calibration, w the weight's (each floored at `SMOOTH_FLOOR` of its median).
    Gemma's activations have a few columns tens of times their neighbours', and per block of 128 one of them sets
    the block's scale alone; divided by s, with the weight's columns times s, the product is the same and the
    blocks' ranges even out (the prefill path's KL against float32 halved; docs/performance.md)."""
    def floored(v: torch.Tensor) -> torch.Tensor:
        v = v.float()
        return v.clamp(min=max(float(v.median()) * SMOOTH_FLOOR, torch.finfo(torch.float32).tiny))

    a, w = floored(column_max), floored(weight.abs().amax(0))
    return (a ** alpha / w ** (1 - alpha)).contiguous()


def tile_pair_budget() -> int | None:
    """The tiles' copy's `pair_budget` on AVX2 (`PAIR_BUDGET`), else None: within it the AVX2 tiles add two lines'
    products in 16 bits, one multiply in four fewer on the pipe that takes them all on Zen 1 (prefill's projections
    1.15-1.3x; docs/performance.md); it raises a block's scale by 7% on average on Gemma's weights."""
    module = kernels.load()
    return module.PAIR_BUDGET if module is not None and module.low_bit_isa() == "avx2" else None


def make_tiles(module: "DecodeLinear", column_max: torch.Tensor | None) -> None:
    """`module`'s copy gets its tiles' copy for the rows past eight, made from the float32 values it kept at load
    (`tiles_source`, then released): int8 in blocks of 128 (`WIDE_BLOCK`) within `tile_pair_budget()`, smoothed by
    `column_max` (the activations' largest magnitude per input column in calibration, `smoothing`) or not (None)."""
    weight, module.tiles_source = module.tiles_source, None
    if weight is None:
        raise ValueError(f"{module!r} kept no values to make a tiles' copy from (made already, or not eligible)")
    s = None if column_max is None else smoothing(column_max, weight)
    q, scales = quantize_per_block(weight if s is None else weight * s, WIDE_BLOCK, tile_pair_budget())
    module.decode.projection.set_tiles(kernels.load().Projection.int8_wide(q, scales, s))
    module.decode = module.decode  # counted as a new copy: what holds the old one (a decode stack) remakes


def decode_copy(weight: torch.Tensor, dtype: torch.dtype) -> Int4Weight | Int8DecodeWeight | None:
    """The copy a weight (float, as loaded) gets in a model of `dtype`: int4 if exactly 4-bit, else int8; None in a
    float32 model, off the CPU or without the kernels."""
    if dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    grid = int4_grid(weight) if Int4Weight.wanted(weight, dtype) else None
    if grid is not None:
        return Int4Weight(*grid, dtype)
    blocks = int8_block_grid(weight) if kernels.has_low_bit() and weight.shape[0] % 16 == 0 else None
    if blocks is not None:
        return Int8DecodeWeight(*blocks, dtype)
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return None
    return Int8DecodeWeight(*quantize_per_channel(weight), dtype)


def set_prefill_weights(model: torch.nn.Module, tiles: bool) -> int:
    """`tiles` (`--prefill-weights int8-128`): the rows past eight on the tiles' copies made by calibration
    (`runtime/models/calibration.py`); else (`gguf`) those copies and the values kept to make them dropped from
    this model for good (their memory back), every row count on the GGUF's own blocks. Returns how many
    projections run their rows past eight on a tiles' copy now."""
    count = 0
    for module in model.modules():
        if not isinstance(module, DecodeLinear):
            continue
        projection = getattr(module.decode, "projection", None)
        if tiles:
            count += int(projection is not None and projection.has_tiles)
            continue
        module.tiles_source = None
        if projection is not None and projection.has_tiles:
            projection.drop_tiles()
            module.decode = module.decode  # counted as a new copy: what holds the old one (a decode stack) remakes
    return count


def _make_copy(module: "DecodeLinear", state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook: the copy from the checkpoint's own values, before they are cast to the
    model's dtype."""
    weight = state_dict.get(prefix + "weight")
    if weight is not None:
        module.decode = decode_copy(weight, module.weight.dtype)
        module.tiles_source = weight.float() if takes_tiles(module.decode, weight) else None


class DecodeLinear(Linear):
    """`Linear` plus a low-bit copy (`decode`) for up to its `max_rows` rows (module docstring). A copy on our
    kernels takes every row count, so its weight keeps no oneDNN pack (about 200 MB for Gemma 3 270M)."""

    # How many times any DecodeLinear's copy was set: what holds copies (the fused decode stack) compares it
    # with the count it was made at instead of looking at every projection each step.
    copies_set = 0

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.decode = None
        # the float32 values the copy was made from, kept (until calibration or `set_prefill_weights`) where a
        # tiles' copy can be made from them (`takes_tiles`, `make_tiles`)
        self.tiles_source: torch.Tensor | None = None
        self.register_load_state_dict_pre_hook(_make_copy)

    @property
    def decode(self) -> Int4Weight | Int8DecodeWeight | None:
        return self._decode

    @decode.setter
    def decode(self, copy: Int4Weight | Int8DecodeWeight | None) -> None:
        DecodeLinear.copies_set += 1
        self._decode = copy

    def wants_pack(self) -> bool:
        copy = self.decode
        return copy is None or copy.max_rows < EVERY_ROW

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        copy = self.decode
        if (copy is not None and x.dim() == 2 and (x.shape[0] <= copy.max_rows or _forced) and x.dtype == copy.dtype
                and x.device.type == "cpu" and not torch.is_grad_enabled() and not torch.compiler.is_compiling()):
            if _forced and x.shape[0] > DECODE_ROWS:  # decode's arithmetic: a few rows at a time, never the tiles'
                return torch.cat([copy.matmul(rows) for rows in x.split(DECODE_ROWS)])
            return copy.matmul(x)
        return linear(x, self.weight, self.packed)

    def extra_repr(self) -> str:
        copy = self.decode
        kind = "int4 (exact)" if isinstance(copy, Int4Weight) else "int8" if copy is None or copy.projection is None or (
            copy.projection.format == "int8") else "int8 per block (exact)"
        if copy is None:
            return super().extra_repr()
        rows = "every row count" if copy.max_rows >= EVERY_ROW else f"up to {copy.max_rows} rows"
        return super().extra_repr() + f", {kind} for {rows}"
