"""Prompt-lookup drafting: when the last n tokens of a request occurred before in its own tokens, guess that
what followed them then follows them again (copying from the prompt, repeating a list, editing a text).

`NgramIndex` keeps, per n in [min_n, max_n], the two latest positions each n-gram ended at, updated as tokens
arrive (O(max_n) per token): the latest is the request's own suffix when it is asked, the one before is the
occurrence to copy from. A proposal costs max_n dictionary lookups however long the request is.
"""

from __future__ import annotations


class NgramIndex:
    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= min_n <= max_n, got {min_n}..{max_n}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.k = num_speculative_tokens
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # n -> gram -> (latest end, the end before it or -1)
        self._ends: list[dict[tuple[int, ...], tuple[int, int]]] = [{} for _ in range(max_n + 1)]

    def extend(self, tokens: list[int]) -> None:
        """Append tokens (the prompt, then each accepted token) and index the n-grams they complete."""
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index = self._ends[n]
                gram = tuple(self.tokens[end - n:end])
                latest = index.get(gram)
                index[gram] = (end, -1 if latest is None else latest[0])

    def propose(self, k: int | None = None) -> list[int]:
        """Up to k (default: num_speculative_tokens) tokens that followed the latest earlier occurrence of the
        longest suffix (max_n down to min_n tokens) that occurred before; [] when none did."""
        k = self.k if k is None else k
        seq, end = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            ends = self._ends[n].get(tuple(seq[end - n:]))
            if ends is not None and ends[1] > 0:
                return seq[ends[1]:ends[1] + k]
        return []
