"""Request → token table: row r holds the full-pool slot of each position of request r.

Row 0 is reserved for padded batch entries (its slot 0 is the padding sink), so real requests get rows
1..max_reqs.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, max_reqs: int, max_context: int, device: str | torch.device = "cpu"):
        self.max_context = max_context
        self.req_to_token = torch.zeros(max_reqs + 1, max_context, dtype=torch.int64, device=device)
        self._free_rows = list(range(1, max_reqs + 1))

    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop(0) if self._free_rows else None

    def free(self, row: int) -> None:
        if row < 1 or row >= self.req_to_token.shape[0] or row in self._free_rows:
            raise ValueError(f"request row {row} is not allocated")
        self._free_rows.append(row)

    def write(self, row: int, start: int, locs: torch.Tensor) -> None:
        if start + locs.numel() > self.max_context:
            raise ValueError(f"request grows past the context limit of {self.max_context} tokens")
        self.req_to_token[row, start:start + locs.numel()] = locs
