"""Request → token table: row r holds the full-pool slot of each position of the request in row r.

The attention backends read keys through it. The scheduler hands out rows 1..max_reqs (plain integers) and
keeps each request's slots in `Req.locs`; the engine mirrors the new slots of each forward into the table.
Row 0 is reserved for padded batch entries (its slot 0 is the padding sink).
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, max_reqs: int, max_context: int, device: str | torch.device = "cpu"):
        self.max_reqs = max_reqs
        self.max_context = max_context
        self.req_to_token = torch.zeros(max_reqs + 1, max_context, dtype=torch.int64, device=device)

    def write(self, row: int, start: int, locs: torch.Tensor) -> None:
        if not 1 <= row <= self.max_reqs:
            raise ValueError(f"request row {row} is outside 1..{self.max_reqs}")
        if start + locs.numel() > self.max_context:
            raise ValueError(f"request grows past the context limit of {self.max_context} tokens")
        self.req_to_token[row, start:start + locs.numel()] = locs
