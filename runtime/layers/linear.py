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

Where the CPU has bfloat16 units, a bfloat16 weight is also kept reordered into oneDNN's blocked layout
(`PackedWeight`, made once when the checkpoint is loaded) and multiplied through oneDNN's linear with that
layout. An unpacked bfloat16 `F.linear` reorders its weight on every call: for the 262144 x 640 LM head of
Gemma 3 270M that is 35 ms of a decode step at batch 8, against 15 ms packed, and 1.5-3x on the layers'
projections at decode sizes, with bit-identical results. float32 weights are not packed: oneDNN's float32
kernel is faster too but rounds differently from the float32 GEMM transformers uses, and float32 is the
dtype held token-exact against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

UPCAST_MIN_ROWS = 32
CPU_HAS_AMX = torch.cpu._is_amx_tile_supported()
CPU_HAS_BF16_UNITS = torch.cpu._is_avx512_bf16_supported() or CPU_HAS_AMX


# oneDNN's prepacked linear, as torch's own CPU compiler uses it; absent from builds without oneDNN.
PACKING = (CPU_HAS_BF16_UNITS and torch.backends.mkldnn.is_available()
           and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
PACK_BATCH_HINT = 8  # the row count oneDNN tunes the layout for; 1 to 600 rows ran as fast or faster packed
# oneDNN makes a primitive for each new row count it multiplies: 6-11 ms a weight shape on a 2-core Xeon with AMX,
# ~110 ms of the first 600-token prefill of Gemma 3 270M (four shapes), and again for every prompt length not seen
# before. Past `ROW_BUCKET` rows the input is padded with zero rows to a multiple of it, so that a prefill chunk of
# up to 2048 rows meets at most 32 row counts, which start-up makes (`warm_row_counts`, 1.2 s for Gemma 3 270M).
# The padding costs its rows (a 600-token prompt's prefill 1.08x the time in one process, alternated: 640 rows);
# a row's values are those of the padded count's product, which oneDNN may sum in another order than the exact
# count's (130 rows against 192 differ by a rounding here and there; 600 against 640 not at all).
ROW_BUCKET = 64


def bucketed_rows(rows: int) -> int:
    """The row count a packed weight multiplies `rows` rows as: up to `ROW_BUCKET` as they are, past it rounded up to
    a multiple of it."""
    return rows if rows <= ROW_BUCKET else -(-rows // ROW_BUCKET) * ROW_BUCKET


class PackedWeight:
    """A bfloat16 CPU weight (out, in) in oneDNN's blocked layout, next to (not instead of) the module's own
    `weight`, which the state dict, lookups and tools keep reading. Not a buffer: derived, never saved, and
    re-made by every `load_state_dict`; an in-place edit of `weight` after loading is not seen by it."""

    def __init__(self, weight: torch.Tensor) -> None:
        with torch.no_grad():
            self.tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        self.dtype = weight.dtype

    @staticmethod
    def wanted(weight: torch.Tensor) -> bool:
        return PACKING and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # (N, in) -> (N, out)
        rows = x.shape[0]
        padded = bucketed_rows(rows)
        if padded != rows:  # zero rows below: their outputs are dropped, a view of the first rows (contiguous)
            x = torch.cat((x, x.new_zeros(padded - rows, x.shape[1])))
        out = torch.ops.mkldnn._linear_pointwise(x, self.tensor, None, "none", [], "")
        return out if padded == rows else out[:rows]


def packed_shapes(model: nn.Module) -> list[PackedWeight]:
    """One packed weight of each distinct shape among `model`'s `Linear` layers (its projections, not a tied head)."""
    shapes: dict[tuple, PackedWeight] = {}
    for module in model.modules():
        if isinstance(module, Linear) and module.packed is not None:
            shapes.setdefault((tuple(module.weight.shape), module.packed.dtype), module.packed)
    return list(shapes.values())


def warm_row_counts(weights: list[PackedWeight], max_rows: int) -> None:
    """Multiply each of `weights` once at every row count a prefill of up to `max_rows` rows pads to
    (`bucketed_rows`), so that no request pays for oneDNN's primitives."""
    with torch.no_grad():
        for packed in weights:
            for rows in range(ROW_BUCKET, bucketed_rows(max_rows) + 1, ROW_BUCKET):
                packed.matmul(torch.zeros(rows, packed.tensor.shape[1], dtype=packed.dtype))


def linear(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None = None) -> torch.Tensor:
    """`x @ weight^T`, through `packed` (the same weight, prepacked) when given and x is a 2-D CPU tensor in
    its dtype (a model moved after loading falls back to `weight`; so does code being compiled, which
    torch's compiler cannot lower the prepacked op in); see the module docstring for bfloat16 on CPUs
    without bfloat16 units."""
    if (packed is not None and x.dtype == packed.dtype and x.dim() == 2 and x.device.type == "cpu"
            and not torch.is_grad_enabled() and not torch.compiler.is_compiling()):
        return packed.matmul(x)
    if (x.dtype == torch.bfloat16 and not CPU_HAS_BF16_UNITS and x.device.type == "cpu"
            and x.numel() >= UPCAST_MIN_ROWS * x.shape[-1]):
        return F.linear(x.float(), weight.float()).to(x.dtype)
    return F.linear(x, weight)


def _pack_on_load(module: nn.Module, incompatible_keys) -> None:
    """load_state_dict post-hook: (re)pack the freshly loaded weight, or drop a stale pack."""
    wanted = PackedWeight.wanted(module.weight) and getattr(module, "wants_pack", lambda: True)()
    module.packed = PackedWeight(module.weight) if wanted else None


class Linear(nn.Module):
    """`y = x @ W^T` without bias; W is (out_features, in_features), uninitialised until loaded."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.packed: PackedWeight | None = None
        self.register_load_state_dict_post_hook(_pack_on_load)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return linear(x, self.weight, self.packed)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Embedding(nn.Module):
    """Token embedding table (num_embeddings, dim), uninitialised until loaded."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        self.packed: PackedWeight | None = None  # for `attend` only; lookups read `weight`
        self.register_load_state_dict_post_hook(_pack_on_load)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, dim)
        return F.embedding(ids, self.weight)

    def attend(self, x: torch.Tensor) -> torch.Tensor:  # (..., dim) -> (..., num_embeddings)
        """The table as an output projection (a tied LM head): scores of `x` against every row."""
        return linear(x, self.weight, self.packed)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"
