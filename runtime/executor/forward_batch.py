"""ForwardBatch: the flattened tokens of one forward and where their KV lives."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.int_tensors import int_tensor


@dataclass(kw_only=True)
class ForwardBatch:
    """One forward over B requests. Extend: each request adds `extend_lens[b]` tokens after a cached prefix
    of `prefix_lens[b]`; decode: each adds one. Tokens are flattened request by request (T tokens in all)."""

    is_decode: bool
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    out_cache_loc: torch.Tensor  # (T,) int64 full-pool slots of the new tokens
    req_rows: list[int]  # (B,) rows of the request→token table
    prefix_lens: list[int]  # (B,) tokens cached before this forward
    seq_lens: list[int]  # (B,) tokens after this forward
    rids: tuple[str, ...] = ()  # (B,) request ids, for the forward's trace span (empty: not traced)
    verify: bool = False  # a speculative verify: logits at every new token, not only each request's last
    live: int | None = None  # a padded static batch: its first `live` requests are real, the rest padding

    @property
    def batch_size(self) -> int:
        return len(self.req_rows)

    @property
    def extend_lens(self) -> list[int]:
        return [s - p for s, p in zip(self.seq_lens, self.prefix_lens)]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def logit_index(self) -> torch.Tensor | slice | None:
        """Rows of the flattened T whose logits the forward returns: each request's last new token, or every
        token for a verify (None: all rows); of a padded static batch, those of its live requests only."""
        if self.verify:
            return None if self.live is None else slice(0, sum(self.extend_lens[:self.live]))
        if self.is_decode and self.num_tokens == len(self.req_rows):  # row b is request b's one token: a view
            # (a gather of the rows cost ~30 us of a batch-1 step, cold after the last step's weights)
            return None if self.live is None else slice(0, self.live)
        index = self.last_token_index()
        return index if self.live is None else index[:self.live]

    def last_token_index(self) -> torch.Tensor:
        """(B,) index of each request's last new token in the flattened T (its logits sample the next)."""
        ends = int_tensor(self.extend_lens).cumsum(0) - 1
        return ends.to(self.input_ids.device)
