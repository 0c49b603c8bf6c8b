"""What the hooked mutations wrote into the full→SWA mapping: the owner's record, to catch every other write.

The allocator's mutations (alloc, free, free_swa, set/clear mapping, clear, register_mapping) are the only
sanctioned writers of the mapping; each one also writes this record and notes the mapping's version. Any
other write — a new helper that moves slots, a numpy or raw-kernel write that no version counter sees, a
pool rebinding the attribute to a rebuilt tensor — leaves the mapping different from the record.

`audit()` runs at the end of every forward. The attribute and the version counter are checked first
(constant time; a moved counter buys a comparison of the whole mapping). A write no counter sees can only be
found by content, and comparing a few hundred thousand rows every forward costs more than the rest of the
telemetry together (measured: 0.2-0.4 ms of a decode step, with the caches full of weights). So each audit
compares the rows the forward translated (a stale row that was read is found in the forward that read it)
and one stripe of `STRIPE_ROWS` rows in turn: a write to rows nobody reads is found within
ceil(rows / STRIPE_ROWS) forwards, before any translation can use it. A mapping of one stripe or less is
compared whole every time. A finding says after which forward the write happened: the latest at whose end
its row was compared and matched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STRIPE_ROWS = 1 << 12

UNSEEN_MAPPING_WRITE = "a write no version counter sees (numpy, a raw kernel)"
# A mapping made under inference_mode tracks no version: a content difference says nothing of the kind of write.
UNKNOWN_MAPPING_WRITE = "written in place (the mapping tracks no version: the kind of write is unknown)"


def tensor_version(t: torch.Tensor) -> int:
    """The tensor's version counter; -1 for tensors created under inference_mode (they track none)."""
    try:
        return t._version
    except RuntimeError:
        return -1


@dataclass(frozen=True, slots=True)
class Finding:
    """An unhooked write: what kind, and the latest forward at whose end the rows involved still matched
    (0: never checked since start-up)."""

    change: str
    clean_through: int


class MappingRecord:
    def __init__(self, mapping: torch.Tensor):
        self.last_audit = 0  # the latest forward whose end was audited
        self.adopt(mapping)

    def adopt(self, mapping: torch.Tensor) -> None:
        """`mapping` is now the sanctioned mapping, as it is (after register_mapping, or after reporting an
        unhooked change once). Every row counts as checked at the latest audit."""
        self.tensor = mapping
        self.values = mapping.clone()
        self.version = tensor_version(mapping)
        self.version_moved = False  # a hooked write found the counter moved by someone else first
        # The latest forward at whose end each stripe was compared; the rows compared by the latest audit.
        self._stripe_checked = [self.last_audit] * -(-mapping.numel() // STRIPE_ROWS)
        self._previous_rows = (torch.empty(0, dtype=torch.int64), 0)
        self._next_stripe = 0

    def write(self, mapping: torch.Tensor, full_locs: torch.Tensor, values) -> None:
        """A hooked mutation: write `values` at `full_locs` into the mapping and into the record. If the version
        counter moved since the record's last write, an unhooked torch write came first: remembered, so that the
        next audit still says so once this write has moved the counter again."""
        if tensor_version(mapping) != self.version:
            self.version_moved = True
        mapping[full_locs] = values
        self.values[full_locs] = values
        self.version = tensor_version(mapping)

    def reset(self, mapping: torch.Tensor) -> None:
        """A hooked clear: every row unmapped, the sentinel kept."""
        self.version_moved = False  # whatever was written before is overwritten
        mapping.zero_()
        mapping[-1] = -1
        self.values.zero_()
        self.values[-1] = -1
        self.version = tensor_version(mapping)

    def unhooked_change(self, mapping: torch.Tensor) -> str | None:
        """Constant-time checks: the attribute rebound, or a write that moved the version counter."""
        if mapping is not self.tensor:
            return "the mapping attribute was rebound to another tensor without register_mapping"
        if tensor_version(mapping) != self.version or self.version_moved:
            return "written in place (its version counter moved)"
        return None

    def audit(self, mapping: torch.Tensor, forward_id: int, rows: torch.Tensor | None = None,
              stripe: bool = True) -> Finding | None:
        """Check the mapping against the record: constant-time checks, then by content the rows `rows` (full-pool
        locations, int32 or int64, none negative) and, with `stripe`, the next stripe. A difference is returned once:
        the record then takes the mapping's rows as they are. Rows checked are marked checked at `forward_id`."""
        change = self.unhooked_change(mapping)
        if change is not None:  # a whole-tensor event: compare everything once, then start over from it
            if mapping is self.tensor and mapping.shape == self.values.shape:
                differ = (mapping != self.values).nonzero().flatten()
                if not differ.numel():  # written in place with what it already held: nothing to report
                    self.version, self.version_moved = tensor_version(mapping), False
                    return None
                change += (f"; {differ.numel()} row(s) differ from what the hooked mutations wrote, first at "
                           f"full slot {int(differ[0])}")
            finding = Finding(change, self.last_audit)
            self.last_audit = forward_id
            self.adopt(mapping)
            return finding
        n = mapping.numel()
        window = None
        if stripe:
            index = self._next_stripe
            window = slice(index * STRIPE_ROWS, min((index + 1) * STRIPE_ROWS, n))
            self._next_stripe = 0 if window.stop == n else index + 1
            if window.stop - window.start == n:
                rows = None  # the stripe is the whole mapping
        if rows is not None and not rows.numel():
            rows = None
        # NOTE: as few tensor operations as possible, on as little memory: this runs at the end of every forward,
        # when the caches hold the weights, and each operation here costs tens of microseconds then.
        stripe_clean = window is None or torch.equal(mapping[window], self.values[window])
        rows_clean = rows is None or torch.equal(mapping.index_select(0, rows), self.values.index_select(0, rows))
        finding = None
        if not (stripe_clean and rows_clean):
            candidates = [] if stripe_clean else [torch.arange(window.start, window.stop, device=mapping.device)]
            if not rows_clean:
                candidates.append(rows.long().to(mapping.device))
            candidates = torch.cat(candidates).unique()  # ascending
            differ = candidates[mapping[candidates] != self.values[candidates]]
            first = int(differ[0])
            kind = UNSEEN_MAPPING_WRITE if self.version != -1 else UNKNOWN_MAPPING_WRITE
            finding = Finding(f"{kind}; {differ.numel()} row(s) differ from what the hooked "
                              f"mutations wrote, first at full slot {first}", self._clean_through(first))
            self.values[differ] = mapping[differ]
        if window is not None:
            self._stripe_checked[index] = forward_id
        if rows is not None:
            self._previous_rows = (rows, forward_id)
        self.last_audit = max(self.last_audit, forward_id)
        return finding

    def audit_whole(self, mapping: torch.Tensor, forward_id: int) -> Finding | None:
        """Compare every row (a load-back about to adopt a rebuilt mapping: not a hot path). The record is left as
        it is: the caller adopts next."""
        if self.unhooked_change(mapping) is not None:
            return self.audit(mapping, forward_id, stripe=False)
        differ = (mapping != self.values).nonzero().flatten()
        if not differ.numel():
            return None
        first = int(differ[0])
        kind = UNSEEN_MAPPING_WRITE if self.version != -1 else UNKNOWN_MAPPING_WRITE
        return Finding(f"{kind}; {differ.numel()} row(s) differ from what the hooked mutations wrote, first at full "
                       f"slot {first}", self._clean_through(first))

    def _clean_through(self, row: int) -> int:
        """The latest forward at whose end `row` was seen to match: its stripe's last check, or the previous audit
        if that one compared this row."""
        through = self._stripe_checked[row // STRIPE_ROWS]
        previous, forward_id = self._previous_rows
        if forward_id > through and bool((previous == row).any()):
            through = forward_id
        return through
