"""Which drafted tokens a verify forward keeps.

A verify forward scores the request's last accepted token followed by its k draft tokens, so it yields k + 1
distributions: p_0 for the first draft position ... p_k for the token after the whole draft.

- Greedy (temperature 0): keep the longest draft prefix equal to the target's own argmax at each position,
  then add the target's argmax after it. The output is exactly what decoding one token at a time gives.
- Sampling: the speculative-sampling rule for a deterministic draft (the proposers here put all their
  probability on one token, q(x) = 1): keep draft token x_i with probability p_i(x_i); at the first rejection
  sample from p_i with x_i removed (max(0, p - q) renormalised); if all k are kept, sample the bonus token
  from p_k. Each emitted token is then distributed exactly as the target's p (the usual proof: P(emit y) =
  p(x) [y = x] + (1 - p(x)) p(y) / (1 - p(x)) [y != x] = p(y)).
"""

from __future__ import annotations

import torch


def accept_greedy(draft: list[int], target_argmax: list[int]) -> list[int]:
    """Tokens to emit: the agreed draft prefix, then the target's own next token (len(target_argmax) == k + 1)."""
    if len(target_argmax) != len(draft) + 1:
        raise ValueError(f"a verify of {len(draft)} draft tokens gives {len(draft) + 1} targets, "
                         f"got {len(target_argmax)}")
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return list(draft[:n]) + [target_argmax[n]]


def accept_sampling(draft: list[int], probs: torch.Tensor, generator: torch.Generator) -> list[int]:
    """Tokens to emit for a deterministic draft, given the target's probabilities `probs` (k + 1, vocab) at the
    draft positions (already shaped by temperature, top-p and top-k). Emits between 1 and k + 1 tokens."""
    k = len(draft)
    if probs.dim() != 2 or probs.shape[0] != k + 1:
        raise ValueError(f"a verify of {k} draft tokens needs ({k + 1}, vocab) probabilities, got {tuple(probs.shape)}")
    probs = probs.float()
    uniform = torch.rand(k, generator=generator, device=probs.device) if k else None
    out = []
    for i, x in enumerate(draft):
        p = probs[i]
        if float(uniform[i]) < float(p[x]):
            out.append(x)
            continue
        residual = p.clone()
        residual[x] = 0.0
        total = float(residual.sum())
        if total <= 0.0:  # p put everything on x but the coin said no (only when p[x] rounds below 1)
            out.append(x)
            continue
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[k], 1, generator=generator)))
    return out
