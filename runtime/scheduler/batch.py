"""What the scheduler hands the engine for one forward: plain Python, no tensors."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.core import Req


@dataclass(frozen=True)
class ScheduledBatch:
    """One forward over `reqs`: request b adds its tokens prefix_lens[b]..seq_lens[b]-1, whose full-pool
    slots are `out_locs` (flattened request by request). `sample` lists the requests (indices into `reqs`)
    whose prompt is now complete: the logits at their last new token pick their next token.
    `fresh_rows` marks requests whose request-table row was (re)assigned since their last forward, so the
    engine writes their whole row (slots 0..seq_len-1), not only the new slots.
    `drafts` (a verify batch, speculative decoding): request b's tokens are its last sampled token followed by
    drafts[b]; the forward scores every one of them, and what the target rejects is rolled back."""

    reqs: tuple[Req, ...]
    is_decode: bool
    prefix_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    out_locs: tuple[int, ...]
    sample: tuple[int, ...]
    fresh_rows: tuple[bool, ...]
    drafts: tuple[tuple[int, ...], ...] = ()

    @property
    def is_verify(self) -> bool:
        return bool(self.drafts)

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return len(self.out_locs)

    def input_ids(self) -> list[int]:
        if self.drafts:
            return [t for r, p, s, d in zip(self.reqs, self.prefix_lens, self.seq_lens, self.drafts)
                    for t in (r.all_ids() + list(d))[p:s]]
        return [t for r, p, s in zip(self.reqs, self.prefix_lens, self.seq_lens) for t in r.all_ids()[p:s]]

    def positions(self) -> list[int]:
        return [i for p, s in zip(self.prefix_lens, self.seq_lens) for i in range(p, s)]
