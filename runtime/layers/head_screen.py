"""A decode step's LM head screened in 4 bits, refined in 8: the bytes (or on AVX2 the work) of an int4 head, the int8
head's top.

At one row the LM head is read, not computed: its 262144 x 640 int8 copy (Gemma 3 270M's Q8_0 table, 178 MB)
is about half of a batch-1 step. A screen keeps the same table a second time as a coarse int4 copy (16 levels
from each group of 32 weights' minimum to its maximum, a float16 step and offset per group: 105 MB; float32 ones
made it 126 MB and its in-step read 20% longer) and the row reads that instead. The screen's logits are within a
few units of the int8 ones (Gemma 3 270M on the reference text of `benchmarks/quality.py`: 0.29 on average, 2.4
at most; 3.35 at most over 280 decode rows after random-id prompts, float16 scales adding 0.04), too coarse to
serve as they are (perplexity +8.6%, top-1 agreement 84%); so every group of 16 tokens with a screened logit
within `REFINE_MARGIN` of the row's largest is recomputed from the int8 copy by the int8 kernel itself
(`Projection.refine`): those logits are the int8 head's to the bit.

What changes against the int8 head alone: only logits more than `REFINE_MARGIN` below the row's largest stay
screened, tokens at under e^-8 (3e-4) of the likeliest one's probability. The greedy token is the int8 head's
whenever the screen errs by less than half the margin at the top (the measured errors above: it was, 280 rows of
280). `benchmarks/quality.py`, decode path: perplexity +0.31% against float32 (+0.03% unscreened), top-1
agreement with transformers unchanged (96.6%). A flat row (the model unsure: one step in seven to twenty after
the bench's random-id prompts) refines most groups and pays for both copies (past half of them, `refine` recomputes
all in order, faster than a list); a peaked one refines a few dozen. Margins 10 and 12 refine more and were slower
than none on the bench's prompts (`docs/performance.md`, "The LM head screened in 4 bits").

On AVX2 a decode batch's rows are screened too (`screen_max_rows`): there the head is computed rather than read, and
the int4 kernel computes it in fewer instructions.

`--lm-head-screen off` keeps the int8 head alone (every logit the int8 head's, e.g. for `logprobs` of rare tokens).
"""

from __future__ import annotations

import functools

import torch

from runtime import kernels

REFINE_MARGIN = 8.0  # logits within this of a row's largest are the int8 head's (module docstring)
# Rows a screen takes where the int8 kernel is AVX2's (`screen_max_rows`): a decode batch's, not a prompt's
# logits (`echo`, the quality benchmark's prefill path), which stay the int8 head's everywhere.
AVX2_SCREEN_ROWS = 32


@functools.cache
def screen_max_rows() -> int:
    """Rows the screen takes. On AVX512-VNNI one, a batch-1 step: there int4 and int8 cost the same instructions a
    multiply-add, so only the bytes gain, and with more rows the rows' near groups added up (one row in seven flat
    on the bench's random-id prompts): at 4 rows the head took 8.8 against 5.3 ms, at 8 rows 11.8 against 6.3. On
    AVX2 a decode batch's too: its int4 kernel sums a block in fewer instructions than its int8 one, so the screen
    computes faster than the int8 head (16 rows of the bench's decode on a 2-core Zen 1 EPYC: 63 against 95 ms), and
    each row refines its own groups (`Projection.refine`), its flat rows recomputed together."""
    return AVX2_SCREEN_ROWS if kernels.low_bit_isa() == "avx2" else 1


def coarse_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q (N, K) int32 in 0..15, step (N, K/32), low (N, K/32)): each group of 32 weights rounded to the nearest of
    16 levels evenly spaced from its minimum to its maximum (lossy, unlike `runtime.layers.int4.int4_grid`), in one
    pass (`runtime/kernels/grids.cpp`; in torch operations the 168M-value head of Gemma 3 270M took 1.3 s of
    start-up)."""
    return kernels.load().coarse_int4(weight.float().contiguous())


class HeadScreen:
    """A coarse int4 copy of an int8 head (our kernels' `Projection`, float16 scales) and the refinement through it."""

    def __init__(self, weight: torch.Tensor, exact) -> None:
        """`weight` (N, K) float, the head's values; `exact`: the int8 head's `Projection` (N, K), whose layout the
        int4 one shares (N a multiple of 16, K of 32)."""
        self.exact = exact
        self.coarse = kernels.load().Projection.int4(*coarse_int4(weight), half_scales=True)
        self.refined_groups = 0  # groups of 16 logits recomputed in 8 bits, since load (tests and benchmarks)

    def logits(self, x2: torch.Tensor) -> torch.Tensor:  # (M, in) -> (M, N) float32
        x2 = x2.contiguous()
        out = self.coarse.matmul(x2, float_out=True)
        self.refined_groups += self.exact.refine(x2, out, REFINE_MARGIN)
        return out

    def nbytes(self) -> int:
        return self.coarse.nbytes
