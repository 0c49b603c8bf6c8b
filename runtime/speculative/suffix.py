"""Suffix drafting: guess continuations from a bounded table of what followed each recent context, learnt from
the request's own tokens and from earlier requests' outputs (agents and templated jobs repeat themselves
across requests, which prompt lookup alone cannot see).

`SuffixTable` maps every context of 1..max_depth tokens seen to the counts of the tokens that followed it: a
suffix tree cut at `max_depth`, flattened into a dictionary. Drafting walks it greedily: the longest context
the table knows, its most frequent next token, repeated up to k times. Memory is bounded by `max_contexts`:
the least recently updated contexts are forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict


class SuffixTable:
    def __init__(self, max_depth: int = 8, max_contexts: int = 200_000):
        if max_depth < 1 or max_contexts < 1:
            raise ValueError(f"max_depth and max_contexts must be >= 1, got {max_depth}, {max_contexts}")
        self.max_depth = max_depth
        self.max_contexts = max_contexts
        self._next: OrderedDict[tuple[int, ...], dict[int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._next)

    def learn(self, tokens: list[int], start: int = 1) -> None:
        """Count what followed each context ending before position i, for i in start..len-1 (give `start` to
        add only the tokens appended since the last call)."""
        table, depth = self._next, self.max_depth
        for i in range(max(start, 1), len(tokens)):
            nxt = tokens[i]
            for d in range(1, min(depth, i) + 1):
                ctx = tuple(tokens[i - d:i])
                counts = table.get(ctx)
                if counts is None:
                    counts = table[ctx] = {}
                    if len(table) > self.max_contexts:
                        table.popitem(last=False)
                else:
                    table.move_to_end(ctx)
                counts[nxt] = counts.get(nxt, 0) + 1

    def propose(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens: at each step the most frequent successor of the longest known suffix of the context
        (ties: the successor seen first); stops where no suffix is known."""
        ctx, out = list(context[-self.max_depth:]), []
        for _ in range(k):
            counts = None
            for d in range(min(self.max_depth, len(ctx)), 0, -1):
                counts = self._next.get(tuple(ctx[-d:]))
                if counts:
                    break
            if not counts:
                break
            token = max(counts, key=counts.__getitem__)
            out.append(token)
            ctx = (ctx + [token])[-self.max_depth:]
        return out


class SuffixProposer:
    """A request's own table (its prompt and output so far) first, the shared table of earlier outputs second."""

    def __init__(self, shared: SuffixTable, num_speculative_tokens: int, max_depth: int = 8):
        self.shared = shared
        self.own = SuffixTable(max_depth)
        self.k = num_speculative_tokens
        self.tokens: list[int] = []

    def extend(self, tokens: list[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(tokens)
        self.own.learn(self.tokens, start)

    def propose(self, k: int | None = None) -> list[int]:
        k = self.k if k is None else k
        return self.own.propose(self.tokens, k) or self.shared.propose(self.tokens, k)

    def finish(self, output: list[int]) -> None:
        """The request ended: what it generated joins the shared table for later requests."""
        self.shared.learn(output)
