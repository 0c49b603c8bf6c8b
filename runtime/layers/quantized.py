"""int8 weights on torch's own kernels: weight-only int8 layers (`int8`), and an int8 LM head (`int8-head`).

Weight-only int8 (`Int8Linear`, `Int8Embedding`) runs on `aten::_weight_int8pack_mm`.

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

The int8 LM head (`Int8HeadEmbedding`, `Int8HeadLinear`) keeps every projection in the model's dtype and only
the output projection in int8, through torch's dynamically quantised linear (`quantized::linear_dynamic`):
int8 weights, per-channel scales, the activations quantised to 8 bits on each call. At batch 1 the LM head
of Gemma 3 270M (262144 x 640) is then 8-9 ms against 15-20 ms for the prepacked bfloat16 matmul, about a
sixth of a decode step; by 8 rows the two are even, and beyond that the int8 kernel falls behind (16 rows:
31 ms against 22), so more rows take the float weight. Its activations are quantised per call, over all
its rows: per token at batch 1, but a few rows at once share one scale. That is why only the head, whose
input is the normalised final hidden state, is quantised this way: perplexity on the reference text
+0.2% (batch 1) / -0.5% (8 rows), against +1.4% and +7.9% with every projection quantised the same way.
Where the CPU has AVX512-VNNI or AVX2 the head runs on our int8 kernel instead (`runtime/kernels`, activations
quantised per block of 32 values rather than one scale a call): 4.2-4.8 against 5.2-6.2 ms at one row, 10.4
against 11.8 ms at eight; the int8-head decode path's perplexity +0.42% against float32. There, at one row, a
coarse 4-bit copy of the head is read first and only the logits near the top are recomputed in int8
(`runtime/layers/head_screen.py`, `--lm-head-screen`).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.decode_linear import INT8_MAX, Int8DecodeWeight, force_decode_copies, quantize_per_channel
from runtime import kernels
from runtime.layers.head_screen import HeadScreen, screen_max_rows
from runtime.layers.int4 import EVERY_ROW, OUR_MAX_ROWS
from runtime.layers.int8_blocks import int8_block_grid
from runtime.layers.linear import CPU_HAS_BF16_UNITS, Embedding, Linear, linear
from runtime.layers.weight_arena import place_decode_weights

KERNEL_DTYPE = torch.bfloat16  # activations and scales as the int8 kernel takes them
DEQUANT_MIN_ROWS = 128
_dequant_min_rows = DEQUANT_MIN_ROWS


@contextmanager
def kernel_path_only() -> Iterator[None]:
    """Every int8 and int4 matmul through its decode kernel (the `int8` format's and the decode copies of
    `runtime/layers/decode_linear.py`, eight rows at a time: past them a copy's rows run in tiles, in blocks of 128
    where it has a tiles' copy), whatever its row count, while inside: scores a whole text in one forward with
    decode's arithmetic (quality measurements). Not thread-safe; not for serving."""
    global _dequant_min_rows
    previous, _dequant_min_rows = _dequant_min_rows, 2**62
    previous_forced = force_decode_copies(True)
    try:
        yield
    finally:
        _dequant_min_rows = previous
        force_decode_copies(previous_forced)


def _dense_in_own_dtype(x: torch.Tensor) -> bool:
    """Whether a dense matmul in x's dtype is fast: always but for bfloat16 on a CPU without bfloat16 units."""
    return x.dtype != torch.bfloat16 or x.device.type != "cpu" or CPU_HAS_BF16_UNITS


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


# ---- int8 LM head: dynamically quantised activations --------------------------------------------------------

DYNAMIC_MAX_ROWS = 8  # rows up to which the int8 head is faster than the float one (module docstring)


def _cpu_has_vnni() -> bool:
    """Whether the CPU multiplies 8-bit integers into 32-bit sums (AVX512-VNNI / AVX-VNNI). Without it the
    x86 kernel adds pairs of products in 16 bits, which can saturate unless activations use 7 bits."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


REDUCE_RANGE = not _cpu_has_vnni()


class DynamicInt8Weight:
    """A float weight (out, in) as per-channel int8 next to the module's own weight, in our kernels' layout
    where the CPU has them (AVX512-VNNI or AVX2; activations quantised per block of 32), else in torch's
    quantized-engine layout
    (`matmul` quantises all rows with one scale); float32 out either way. Made at load time
    from the checkpoint's values; an in-place edit of the weight afterwards is not seen by it."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = None
        # Where the CPU has AVX512-VNNI or AVX2, our kernel (activations in int8 blocks of 32, not one scale a call):
        # the 168 MB head of Gemma 3 270M at one row in 4.2 against 5.2 ms (`runtime/layers/decode_linear.py`);
        # a Q8_0 table (Gemma 3 270M's) used exactly there, its float16 scale per block of 32 kept
        # (`runtime/layers/int8_blocks.py`: teacher-forced greedy agreement with transformers 96.6 against 94.7%).
        blocks = int8_block_grid(weight) if kernels.has_low_bit() and weight.shape[0] % 16 == 0 else None
        q, scales = blocks if blocks is not None else quantize_per_channel(weight)
        copy = Int8DecodeWeight(q, scales, torch.bfloat16)
        self.kernel_weight = copy if copy.projection is not None else None
        self.max_rows = DYNAMIC_MAX_ROWS  # torch's kernel; ours every row count but with AMX (OUR_MAX_ROWS: decode batches)
        # a batch-1 row reads a coarse int4 copy and refines its top in 8 bits (`runtime/layers/head_screen.py`)
        self.screen = None
        if self.kernel_weight is not None:
            self.max_rows = OUR_MAX_ROWS
            self.screen = HeadScreen(weight, copy.projection)
            return
        zero = torch.zeros(scales.shape, dtype=torch.int64)
        with warnings.catch_warnings():  # the quantized tensor API warns that it is deprecated
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch._make_per_channel_quantized_tensor(q, scales.double(), zero, 0)
            self.packed = torch.ops.quantized.linear_prepack(qweight, None)

    @staticmethod
    def wanted(weight: torch.Tensor) -> bool:
        """CPU weights, where torch has the x86 kernels and the (deprecated) quantized-tensor API; otherwise
        the float head serves every row."""
        return (weight.device.type == "cpu" and "x86" in torch.backends.quantized.supported_engines
                and hasattr(torch, "_make_per_channel_quantized_tensor")
                and hasattr(torch.ops.quantized, "linear_dynamic") and hasattr(torch.ops.quantized, "linear_prepack"))

    def takes(self, x2: torch.Tensor) -> bool:
        """Whether these rows (N, in) go through the int8 weight: no more than it takes, on CPU, not for autograd
        or a compiler."""
        return (x2.shape[0] <= self.max_rows and x2.device.type == "cpu" and not torch.is_grad_enabled()
                and not torch.compiler.is_compiling())

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:  # (N, in) -> (N, out) float32
        if self.screen is not None and x2.shape[0] <= screen_max_rows():
            return self.screen.logits(x2)
        if self.kernel_weight is not None:  # bfloat16 or float32 rows, quantised the same way
            return self.kernel_weight.matmul(x2, float_out=True)
        return torch.ops.quantized.linear_dynamic(x2.float(), self.packed, REDUCE_RANGE)


def _head_matmul(module: nn.Module, x: torch.Tensor, logits: bool = False) -> torch.Tensor:
    """x (..., in) @ W^T for an int8 head: the int8 weight for few rows, the float weight (and its oneDNN
    pack) otherwise; in x's dtype, or with `logits` in float32 (the int8 kernels' sums unrounded: a bfloat16
    round trip of 262144 logits cost ~0.3 ms a decode step)."""
    x2 = x.reshape(-1, x.shape[-1])
    if module.int8 is None or not module.int8.takes(x2):
        out = linear(x, module.weight, module.packed)
        return out.float() if logits else out
    out = module.int8.matmul(x2).view(*x.shape[:-1], -1)
    return out if logits else out.to(x.dtype)


def _make_int8_head(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook: the int8 copy from the checkpoint's own values (float32 from the loader),
    before they are cast to the model's dtype."""
    weight = state_dict.get(prefix + "weight")
    if weight is not None:
        module.int8 = DynamicInt8Weight(weight) if DynamicInt8Weight.wanted(weight) else None


def _hold_int8_head(module: nn.Module) -> None:
    """Give a float head module its (empty until loaded) int8 copy."""
    module.int8 = None
    module.register_load_state_dict_pre_hook(_make_int8_head)


def _head_wants_pack(module: nn.Module) -> bool:
    """A oneDNN pack of the float weight only where some row count still multiplies it: not beside a copy on our
    kernels (which takes every one; for Gemma 3 270M's tied head that pack is 335 MB)."""
    return module.int8 is None or module.int8.max_rows < EVERY_ROW


class Int8HeadEmbedding(Embedding):
    """The token table in the model's dtype for lookups, and as the tied LM head an int8 copy for decode's few
    rows (`DynamicInt8Weight`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        _hold_int8_head(self)

    def attend(self, x: torch.Tensor) -> torch.Tensor:  # (..., dim) -> (..., num_embeddings)
        return _head_matmul(self, x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:  # (..., dim) -> (..., num_embeddings) float32
        return _head_matmul(self, x, logits=True)

    def wants_pack(self) -> bool:
        return _head_wants_pack(self)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", LM head int8 (dynamic)" + _rows_text(self.int8)


class Int8HeadLinear(Linear):
    """An untied LM head: the weight in the model's dtype, and an int8 copy for decode's few rows."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        _hold_int8_head(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return _head_matmul(self, x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out) float32
        return _head_matmul(self, x, logits=True)

    def wants_pack(self) -> bool:
        return _head_wants_pack(self)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", int8 (dynamic)" + _rows_text(self.int8)


def _rows_text(copy: DynamicInt8Weight | None) -> str:
    rows = DYNAMIC_MAX_ROWS if copy is None else copy.max_rows
    text = " for every row count" if rows >= EVERY_ROW else f" up to {rows} rows"
    if copy is not None and copy.screen is not None:
        text += f", screened in 4 bits up to {screen_max_rows()} row(s)"
    return text


def set_head_screen(model: nn.Module, on: bool) -> bool:
    """Screen the int8 LM head's decode rows (`runtime/layers/head_screen.py`) or not; off drops the screen's copy
    from this model for good (its memory back: the other decode copies are placed in a new buffer without it,
    `runtime/layers/weight_arena.py`). Returns whether the head is screened now."""
    head = model.model.embed_tokens if model.lm_head is None else model.lm_head
    copy = getattr(head, "int8", None)
    if copy is None or getattr(copy, "screen", None) is None:
        return False
    if not on:
        copy.screen = None
        if getattr(model, "decode_arena", None) is not None:
            model.decode_arena = place_decode_weights(model)
    return copy.screen is not None
