"""Next-token sampling: greedy at temperature 0, else temperature/top-p/top-k sampling; log probabilities.

Numerically safe for every parameter `SamplingParams` accepts: logits are shifted so that their maximum is
0 *before* dividing by the temperature (in float64), so a tiny temperature (1e-40, 5e-324) sends every
other logit to -inf (greedy in the limit) instead of overflowing to inf and feeding NaN to `multinomial`. The top token
always survives top-k and top-p, so a row never ends with all-zero probabilities. A row whose logits are
NaN or +inf (a model failure) raises `SamplingError` naming the row; the caller fails that request alone.
"""

from __future__ import annotations

import math

import torch

from runtime import kernels
from runtime.core import SamplingParams


class SamplingError(ValueError):
    """A row of logits that no token can be drawn from."""


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generator: torch.Generator | list[torch.Generator | None] | None = None) -> list[int]:
    """One token per row of `logits` (B, vocab), each row with its own parameters and, given a list, its own
    generator (a seeded request draws from its own, so its tokens do not depend on the rest of the batch)."""
    logits = logits.float()
    # One pass over (B, vocab) does both jobs: a row's maximum is NaN if any logit is NaN (max propagates
    # NaN), +inf if one is +inf, -inf if all are; and its index is the greedy token (the first maximal one,
    # as argmax picks).
    top, greedy = row_max(logits)  # (B,), (B,)
    bad = [i for i, value in enumerate(top.tolist()) if not math.isfinite(value)]  # a few rows: cheaper as a list
    if bad:
        raise SamplingError(f"non-finite logits in row(s) {bad} of {logits.shape[0]}: nothing to sample from")
    greedy = greedy.tolist()
    out = []
    for i, p in enumerate(params):
        if p.temperature == 0.0:
            out.append(greedy[i])
            continue
        gen = generator[i] if isinstance(generator, list) else generator
        out.append(int(torch.multinomial(_probabilities(logits[i], p), 1, generator=gen)))
    return out


def row_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits.max(-1)` (float32 rows): through the kernels' vector pass when they are loaded (the same values and
    first indices; torch's takes ~130 us a row of 262144 on one thread, 1.5% of a batch-1 decode step)."""
    fused = kernels.loaded()
    if fused is not None and logits.device.type == "cpu" and logits.dim() == 2 and logits.is_contiguous():
        top, index = fused.row_argmax(logits)
        return top, index
    return logits.max(-1)


def check_finite(logits: torch.Tensor) -> None:
    """Raise SamplingError unless every row of `logits` (N, vocab) has a finite maximum."""
    bad = ~torch.isfinite(row_max(logits.float())[0])
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise SamplingError(f"non-finite logits in row(s) {rows} of {logits.shape[0]}: nothing to sample from")


def token_probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """(N, vocab) float64 probabilities that sampling with `p` (temperature > 0) draws from, per row: what
    speculative sampling holds draft tokens against."""
    check_finite(logits)
    return torch.stack([_probabilities(row, p) for row in logits.float()])


def _probabilities(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row's sampling distribution under temperature, top-k and top-p."""
    # float64: a temperature below float32's smallest subnormal (e.g. 5e-324) would round to 0 there
    row = (row.double() - row.max()) / p.temperature  # <= 0, the top token at exactly 0; others may be -inf
    if p.top_k:
        kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        drop = sorted_p.cumsum(0) - sorted_p > p.top_p  # never the first: its exclusive sum is 0
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return probs


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: list[int]) -> list[tuple[float, list]]:
    """Per row of `logits` (B, vocab): the log probability of `tokens[i]` and the `top[i]` most likely
    (id, log probability) pairs, from a float32 log_softmax of the raw logits (before temperature, top-k and
    top-p: the model's own distribution, as vLLM reports by default)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, vocab)
    chosen = logp.gather(1, torch.tensor(tokens, dtype=torch.int64, device=logp.device)[:, None])[:, 0].tolist()
    k = max(top, default=0)
    values, ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())  # (B, k)
    values, ids = values.tolist(), ids.tolist()
    return [(chosen[i], list(zip(ids[i][:top[i]], values[i][:top[i]]))) for i in range(len(tokens))]
