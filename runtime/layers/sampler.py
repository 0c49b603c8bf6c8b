"""Next-token sampling: greedy at temperature 0, else temperature/top-p/top-k sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be within [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be within (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


def sample(logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator | None = None) -> list[int]:
    """One token per row of `logits` (B, vocab), each row with its own parameters."""
    out = []
    for row, p in zip(logits.float(), params):
        if p.temperature == 0.0:
            out.append(int(row.argmax()))
            continue
        row = row / p.temperature
        if p.top_k:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            drop = sorted_p.cumsum(0) - sorted_p > p.top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        out.append(int(torch.multinomial(probs, 1, generator=generator)))
    return out
