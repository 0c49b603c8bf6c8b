"""The scheduler's view of speculative decoding: one drafter per running request, a shared suffix table, and
back-off where drafts keep failing.

Drafts are plain token ids planned with the decode step: the scheduler asks `draft(req, limit)` for each
decode request, gives the request 1 + len(draft) new slots, and the engine scores them in one verify forward.
`record(req, drafted, accepted)` learns how it went. A request whose drafts were all rejected waits before it
drafts again (1, 2, 4, ... up to `MAX_COOLDOWN` steps; one accepted draft token resets it), so a workload
with nothing to copy decodes as if speculation were off, at the cost of an occasional lookup.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.speculative.ngram import NgramIndex
from runtime.speculative.suffix import SuffixProposer, SuffixTable

MAX_COOLDOWN = 32  # decode steps a request waits, at most, after a fully rejected draft


@dataclass
class _State:
    drafter: NgramIndex | SuffixProposer
    seen: int = 0  # tokens of the request handed to the drafter so far
    cooldown: int = 0  # steps left before the next draft
    backoff: int = 0  # the next cooldown after a failed draft


class Speculator:
    def __init__(self, algorithm: str, num_speculative_tokens: int, lookup_min: int = 1, lookup_max: int = 4,
                 stats=None):
        if algorithm not in ("ngram", "suffix"):
            raise ValueError(f"unknown speculative algorithm {algorithm!r}")
        self.algorithm = algorithm
        self.k = num_speculative_tokens
        self.lookup = (lookup_min, lookup_max)
        self.shared = SuffixTable() if algorithm == "suffix" else None  # earlier outputs, bounded
        self.stats = stats  # telemetry SpecStats
        self._states: dict[str, _State] = {}

    def draft(self, req, limit: int) -> tuple[int, ...]:
        """At most min(k, limit) tokens guessed to follow `req`'s tokens so far; () to decode plainly."""
        state = self._states.get(req.rid)
        if state is None:
            drafter = (NgramIndex(self.k, *self.lookup) if self.shared is None
                       else SuffixProposer(self.shared, self.k))
            state = self._states[req.rid] = _State(drafter)
        ids = req.all_ids()
        if len(ids) > state.seen:
            state.drafter.extend(ids[state.seen:])
            state.seen = len(ids)
        if state.cooldown:
            state.cooldown -= 1
            return ()
        n = min(self.k, limit)
        return tuple(state.drafter.propose(n)) if n > 0 else ()

    def record(self, req, drafted: int, accepted: int) -> None:
        """A verify of `drafted` tokens kept `accepted` of them."""
        if self.stats is not None:
            self.stats.record_verify(self.algorithm, drafted, accepted)
        state = self._states.get(req.rid)
        if state is None or not drafted:
            return
        if accepted:
            state.backoff = 0
        else:
            state.backoff = min(max(1, 2 * state.backoff), MAX_COOLDOWN)
            state.cooldown = state.backoff

    def finish(self, req) -> None:
        """The request ended (or was dropped): forget it; its output teaches the shared table."""
        state = self._states.pop(req.rid, None)
        if state is not None and self.shared is not None and req.output_ids:
            state.drafter.finish(req.output_ids)
