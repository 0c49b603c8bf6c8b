"""The ground truth of `diagnose`: every request recomputed densely, with none of the build's memory code.

A run's outputs are held against the same model evaluated over each request's whole token history (prompt
and generated tokens) in one forward, with plain causal attention (windowed on sliding layers) over the
keys of that forward itself: no KV pool, allocator, mapping, translation cache, prefix cache, host tier or
graph buffer takes part. A bug in any of those that corrupts every policy alike (the uncached `off` run
included) still differs from this reference.

Dense and paged attention add the same numbers in a different order, so their logits differ by rounding:
`LOGIT_RTOL` and `LOGIT_ATOL` bound that difference (measured as said beside them), and a sampled token counts
as wrong only where the reference's own logits rule it out by more than that bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.context import ForwardContext, forward_context
from runtime.diagnose.workload import Mismatch, RunResult

# Dense and paged logits of a clean build differ by rounding. Measured in float32 with one thread over every
# diagnose setup and policy of the tiny model (2940 tokens, logits up to 46.5): at most 3.5e-5, and at most
# 1.3e-6 of the largest |logit| of the token's row. The bound is relative to that scale, with a floor, so
# that it carries over to larger models: here it sits about 80x above the measurement; on Gemma 3 270M (two
# requests of 552 and 521 tokens, six generated each) the difference was at most 3.9e-6 relative, about 25x below.
LOGIT_RTOL = 1e-4
LOGIT_ATOL = 1e-5

class DenseAttention:
    """Attention backend over the T tokens of one sequence (token i at position i): causal, and on sliding
    layers limited to the last `sliding_window` tokens. No KV cache: keys and values are this forward's."""

    def forward(self, q, k, v, layer):  # q (T, H, D), k/v (T, Hkv, D) -> (T, H, D)
        T, H, _ = q.shape
        group = H // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1)  # (T, H, D): query head h reads kv head h // group
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * layer.scaling  # (H, T, T)
        if layer.logit_softcapping:
            scores = torch.tanh(scores / layer.logit_softcapping) * layer.logit_softcapping
        i = torch.arange(T, device=q.device)
        visible = i[None, :] <= i[:, None]  # (Tq, Tk)
        if layer.sliding_window is not None:
            visible &= i[:, None] - i[None, :] < layer.sliding_window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)  # (T, H, D)


@dataclass
class Deviation:
    """How one request's outputs differ from the reference: tokens ruled out by it, and the largest
    |logit difference| beyond tolerance (0.0 when within)."""

    tokens_differ: int
    max_logit_diff: float


class DenseReference:
    """Reference logits of token histories, computed once per distinct history (clean runs of every policy
    and configuration share them)."""

    def __init__(self, model):
        self.model = model
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(self, history: list[int]) -> torch.Tensor:
        """(len(history), vocab) float32: at position i, the logits of the token after history[:i + 1]."""
        key = tuple(history)
        if key not in self._logits:
            ids = torch.tensor(history, dtype=torch.int64)
            ctx = ForwardContext(forward_id=0, mode="eager_extend", attn_backend=DenseAttention())
            with torch.no_grad(), forward_context(ctx, bind_logging=False):
                hidden = self.model(ids, torch.arange(ids.numel()))  # (T, hidden)
                self._logits[key] = self.model.compute_logits(hidden).float()  # (T, vocab)
        return self._logits[key]

    def check(self, prompt: list[int], tokens: list[int], logits: torch.Tensor) -> Deviation:
        """Hold one greedy request against the reference: `logits` (N, vocab) are those its N `tokens` were
        sampled from. Token n is wrong when the reference scores it below its own best by more than the
        tolerance (a near tie may go either way: that is rounding, not corruption)."""
        n = min(len(tokens), len(logits))
        missing = abs(len(tokens) - len(logits))
        if n == 0:
            return Deviation(missing, 0.0)
        ref = self.logits(prompt + tokens[:n - 1])[len(prompt) - 1:]  # (n, vocab)
        tol = LOGIT_ATOL + LOGIT_RTOL * ref.abs().amax(dim=-1)  # (n,)
        diff = (logits[:n].float() - ref).abs().amax(dim=-1)  # (n,)
        chosen = ref.gather(1, torch.tensor(tokens[:n])[:, None])[:, 0]  # (n,)
        wrong = int((chosen < ref.amax(dim=-1) - 2 * tol).sum()) + missing
        over = diff > tol
        return Deviation(wrong, float(diff[over].max()) if bool(over.any()) else 0.0)


def reference_mismatches(reference: DenseReference, run: RunResult) -> list[Mismatch]:
    """The phases of `run` whose outputs the dense reference contradicts; each marked undetected
    when no bug-class event was counted during that phase."""
    out = []
    for phase, output in run.outputs.items():
        found = [reference.check(p, t, l) for p, t, l in zip(output.prompts, output.tokens, output.logits)]
        differ = sum(d.tokens_differ for d in found)
        diff = max((d.max_logit_diff for d in found), default=0.0)
        if differ or diff:
            total = sum(len(t) for t in output.tokens)
            out.append(Mismatch(phase, differ, total, diff, run.setup, undetected=run.bug_events_in(phase) == 0))
    return out
