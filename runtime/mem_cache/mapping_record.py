"""What the hooked mutations wrote into the full→SWA mapping: the owner's record, to catch every other write.

The allocator's mutations (alloc, free, free_swa, set/clear mapping, clear, register_mapping) are the only
sanctioned writers of the mapping; each one also writes this record and notes the mapping's version. Any
other write — a new helper that moves slots, a numpy or raw-kernel write that no version counter sees, a
pool rebinding the attribute to a rebuilt tensor — leaves the mapping different from the record, and
`unhooked_change()` says which kind it was (cheap checks), or `unhooked_rows()` finds it by content (one
comparison of the whole mapping, done once per forward).
"""

from __future__ import annotations

import torch


def tensor_version(t: torch.Tensor) -> int:
    """The tensor's version counter; -1 for tensors created under inference_mode (they track none)."""
    try:
        return t._version
    except RuntimeError:
        return -1


class MappingRecord:
    def __init__(self, mapping: torch.Tensor):
        self.adopt(mapping)

    def adopt(self, mapping: torch.Tensor) -> None:
        """`mapping` is now the sanctioned mapping, as it is (after register_mapping, or after reporting an
        unhooked change once)."""
        self.tensor = mapping
        self.values = mapping.clone()
        self.version = tensor_version(mapping)

    def write(self, mapping: torch.Tensor, full_locs: torch.Tensor, values) -> None:
        """A hooked mutation: write `values` at `full_locs` into the mapping and into the record."""
        mapping[full_locs] = values
        self.values[full_locs] = values
        self.version = tensor_version(mapping)

    def reset(self, mapping: torch.Tensor) -> None:
        """A hooked clear: every row unmapped, the sentinel kept."""
        mapping.zero_()
        mapping[-1] = -1
        self.values.zero_()
        self.values[-1] = -1
        self.version = tensor_version(mapping)

    def unhooked_change(self, mapping: torch.Tensor) -> str | None:
        """Constant-time checks: the attribute rebound, or a write that moved the version counter."""
        if mapping is not self.tensor:
            return "the mapping attribute was rebound to another tensor without register_mapping"
        if tensor_version(mapping) != self.version:
            return "written in place (its version counter moved)"
        return None

    def unhooked_rows(self, mapping: torch.Tensor) -> str | None:
        """The content check: rows that differ from what the hooked mutations wrote (any write path)."""
        if mapping is not self.tensor or mapping.shape != self.values.shape:
            return self.unhooked_change(mapping)
        if torch.equal(mapping, self.values):
            return None
        differ = (mapping != self.values).nonzero().flatten()
        kind = self.unhooked_change(mapping) or "a write no version counter sees (numpy, a raw kernel)"
        return f"{kind}; {differ.numel()} row(s) differ from what the hooked mutations wrote, first at full slot {int(differ[0])}"
