"""The KV sanitizer: every KV write and attention read checked against the ownership ledger (docs/kv-sanitizer.md).

The translation guard catches a cached translation that went stale against the mapping; it cannot see a
location that is wrong while the mapping and the cache agree. Here the location actually used is held
against who owns the slot (`ownership.py`, fed where slots change hands, never from the request table or the
mapping being checked):

- a write (`check_write`, from the pool's `set_kv_buffer`): the full slot of each new token is owned by (its
  request's table row, its position); its SWA slot is owned by that full slot; a padded entry (table row 0)
  writes only the sink, slot 0. Otherwise `foreign_slot_write` at site `kv_write`.
- a read (`check_read`, from the backend before it attends): each key a request reads at position p is the
  full slot owned by (that request, p) or by the prefix cache at p, and on sliding layers the SWA slot that
  full slot owns. A free slot or an unmapped SWA side read is `freed_slot_read`, any other owner
  `foreign_slot_read`, at site `kv_read`.

A slot the allocator handed out but nobody claimed (a runner driven without the scheduler) is claimed by the
first token that writes it. Modes: `strict` checks every write and every read of every layer; `sampled` checks
the write locations of every forward once (the first full-pool and the first SWA write: they are the same
tensors on every layer) and the reads of one forward in `SAMPLE_EVERY`. An event is counted once per forward,
site and classification and reported through the `EventReporter` with the slot, its pool, the expected and
the actual owner, and the code path that last allocated, freed or moved the slot.
"""

from __future__ import annotations

import torch

from runtime import kernels
from runtime.int_tensors import int_tensor
from runtime.mem_cache.ownership import FREE, TREE, UNCLAIMED, OwnershipLedger
from telemetry.events import KeyChangeEvent, caller_stack

SAMPLE_EVERY = 16  # sampled mode: the reads of forward ids divisible by this are checked
FIRST_WRITE = "claimed by the first KV write of its token"


class NullSanitizer:
    """`--kv-sanitizer off` (or telemetry off): nothing kept, nothing checked."""

    mode = "off"

    def begin_forward(self, forward_id: int, mode: str) -> None: ...

    def end_forward(self) -> None: ...

    def bind(self, batch, table: torch.Tensor) -> None: ...

    def check_write(self, loc: torch.Tensor, swa_loc: torch.Tensor | None) -> None: ...

    def check_read(self, keys, sliding: bool) -> None: ...

    def check_host_copy(self, full: torch.Tensor, swa: torch.Tensor, first_pos: int) -> torch.Tensor:
        """Off: an in-window token without an SWA slot stops the copy, as it always did."""
        if bool((swa <= 0).any()):
            raise RuntimeError("offload: an in-window token has no SWA slot")
        return swa


class KVSanitizer(NullSanitizer):
    def __init__(self, ledger: OwnershipLedger, reporter, policy: str, mode: str = "sampled",
                 sample_every: int = SAMPLE_EVERY):
        if mode not in ("sampled", "strict"):
            raise ValueError(f"sanitizer mode must be 'sampled' or 'strict', got {mode!r}")
        self.ledger = ledger
        self.reporter = reporter
        self.policy = policy
        self.mode = mode
        self.strict = mode == "strict"
        self.sample_every = sample_every
        self.forward_id, self.forward_mode = 0, "none"
        self._reads_due = False
        self._reported: set[tuple[str, str]] = set()  # (site, classification) counted in this forward
        self._unbind()

    # ---- the forward and its batch ------------------------------------------------------------------------
    def begin_forward(self, forward_id: int, mode: str) -> None:
        self.forward_id, self.forward_mode = forward_id, mode
        self.ledger.begin_forward(forward_id)
        self._reads_due = self.strict or forward_id % self.sample_every == 0
        self._reported.clear()
        self._unbind()

    def end_forward(self) -> None:
        self.ledger.end_forward()
        self._unbind()

    def _unbind(self) -> None:
        self._rows: torch.Tensor | None = None  # (T,) table row of each new token (0: padding)
        self._pos: torch.Tensor | None = None  # (T,) its position
        self._batch = None
        self._table: torch.Tensor | None = None
        self._writes_done: set[str] = set()
        self._key_owners: dict[int, tuple] = {}  # id(key list) -> (list, rows, positions, real)

    def bind(self, batch, table: torch.Tensor) -> None:
        """The batch whose tokens the next writes and reads belong to (from the backend's metadata init)."""
        self._unbind()
        self._batch, self._table = batch, table
        rows = int_tensor(batch.req_rows)
        if not batch.is_decode:  # a decode token per request needs no repeat (the common, hot case)
            rows = torch.repeat_interleave(rows, torch.tensor(batch.extend_lens))
        self._rows = rows
        self._pos = batch.positions.long().cpu()

    # ---- writes -------------------------------------------------------------------------------------------
    def check_write(self, loc: torch.Tensor, swa_loc: torch.Tensor | None) -> None:
        """`loc` (T,) full slots of the batch's new tokens; `swa_loc` the SWA slots a sliding layer writes."""
        if self._rows is None or loc.numel() != self._rows.numel():
            return  # not the bound batch's write (a test writing the pool directly)
        full_due = self.strict or "full" not in self._writes_done
        swa_due = swa_loc is not None and (self.strict or "swa" not in self._writes_done)
        if not (full_due or swa_due):
            return  # sampled: every layer writes the same locations, checked at the first of each pool
        if self._writes_owned(loc, swa_loc if swa_due else None, full_due):
            self._writes_done.update(kind for kind, due in (("full", full_due), ("swa", swa_due)) if due)
            return
        loc = loc.long().cpu()
        if full_due:
            self._writes_done.add("full")
            self._check_full_write(loc)
        if swa_due:
            self._writes_done.add("swa")
            self._check_swa_write(loc, swa_loc.long().cpu())

    def _writes_owned(self, loc: torch.Tensor, swa_loc: torch.Tensor | None, full: bool) -> bool:
        """Whether the checks below would find every write in order with nothing to claim, in one call to the
        fused kernels where something loaded them (`runtime/kernels/ledger.cpp`: 70-85 us of torch operations
        in a batch-1 decode step, where they run first and cold). False sends the write to the torch checks."""
        fused = kernels.loaded()
        if fused is None:
            return False
        return fused.writes_owned(self.ledger.full.owner, self.ledger.full.pos, loc, self._rows, self._pos,
                                  self.ledger.swa.owner, swa_loc, full)

    def _check_full_write(self, loc: torch.Tensor) -> None:
        full, rows, pos = self.ledger.full, self._rows, self._pos
        pad = rows == 0
        owner = full.owner[loc]
        unclaimed = (owner == UNCLAIMED) & ~pad
        if bool(unclaimed.any()):
            full.set(loc[unclaimed], rows[unclaimed], pos[unclaimed], self.ledger.stamp(FIRST_WRITE))
            owner = torch.where(unclaimed, rows, owner)
        ok = torch.where(pad, loc == 0, (owner == rows) & (full.pos[loc] == pos))
        if bool(ok.all()):
            return
        bad = (~ok).nonzero().flatten()
        i = int(bad[0])
        slot = int(loc[i])
        self._report("kv_write", "foreign_slot_write", "full", slot, self._token_text(i), bad.numel(),
                     self.ledger.owner_text("full", slot), self.ledger.path_text("full", slot))

    def _check_swa_write(self, loc: torch.Tensor, swa: torch.Tensor) -> None:
        pad = self._rows == 0
        ok = torch.where(pad, swa == 0, (swa > 0) & (self.ledger.swa.owner[swa] == loc))
        if bool(ok.all()):
            return
        bad = (~ok).nonzero().flatten()
        i = int(bad[0])
        slot, full_slot = int(swa[i]), int(loc[i])
        if pad[i]:
            expected = "the padding sink (slot 0)"
        else:
            expected = f"the token at full slot {full_slot} ({self._token_text(i)})"
        if slot == 0 and not pad[i]:
            actual, path = "the sink: its token has no SWA slot", self.ledger.path_text("full", full_slot, side=True)
        else:
            actual, path = self.ledger.owner_text("swa", slot), self.ledger.path_text("swa", slot)
        self._report("kv_write", "foreign_slot_write", "swa", slot, expected, bad.numel(), actual, path)

    def _token_text(self, i: int) -> str:
        row = int(self._rows[i])
        if row == 0:
            return "the padding sink (slot 0): a padded batch entry"
        return f"{self.ledger.request_text(row)} position {int(self._pos[i])}"

    # ---- reads --------------------------------------------------------------------------------------------
    def check_read(self, keys, sliding: bool) -> None:
        """`keys` (KVIndexList): the slots attention is about to gather for each request of the bound batch;
        full-pool slots, or on a sliding layer SWA slots."""
        if self._rows is None or not self._reads_due:
            return
        owners = self._key_owners.get(id(keys))
        if owners is not None and owners[0] is keys:
            if not self.strict:
                return  # sampled: each key list once per forward
        else:
            owners = self._key_owners[id(keys)] = (keys, *self._owners_of(keys))
        _, rows, pos, real = owners
        slots = keys.indices.long().cpu()
        if real is not None:
            slots = slots[real]
        if not sliding:
            self._check_full_read(slots, rows, pos)
            return
        full_slots = self._table[rows, pos].cpu()  # what the request table says each position is
        if self._check_full_read(full_slots, rows, pos):
            self._check_swa_read(slots, full_slots, rows, pos)

    def _owners_of(self, keys) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(rows, positions) of the real keys of a key list, and the mask of real keys (None: no padding)."""
        indptr, req_rows = keys.indptr_list, self._batch.req_rows
        lens = torch.tensor([b - a for a, b in zip(indptr, indptr[1:])])
        first = [s - a for s, a in zip(keys.start_list, indptr)]  # position of key i of request b: i + first[b]
        rows, first = torch.repeat_interleave(torch.tensor([req_rows, first]), lens, dim=1)  # (2, N) -> 2 x (N,)
        pos = first + torch.arange(indptr[-1])
        if 0 not in req_rows:
            return rows, pos, None
        real = rows != 0
        return rows[real], pos[real], real

    def _check_full_read(self, slots: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor) -> bool:
        full = self.ledger.full
        owner = full.owner[slots]
        at_pos = full.pos[slots] == pos
        cached = (owner == TREE) & at_pos
        ok = ((owner == rows) & at_pos) | cached
        if bool(cached.any()):  # a prefix-cache slot: the one the request's own prefix match gave it
            ok[cached] = self._matched(slots[cached], rows[cached], pos[cached])
        if bool(ok.all()):
            return True
        bad = (~ok).nonzero().flatten()
        freed = owner[bad] == FREE
        for classification, which in (("freed_slot_read", freed), ("foreign_slot_read", ~freed)):
            if bool(which.any()):
                i = int(bad[which][0])
                slot = int(slots[i])
                self._report("kv_read", classification, "full", slot,
                             f"{self.ledger.request_text(int(rows[i]))} position {int(pos[i])}", int(which.sum()),
                             self.ledger.owner_text("full", slot), self.ledger.path_text("full", slot))
        return False

    def _matched(self, slots: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Per key: the cache slot read at (row, position) is the one the row's prefix match holds there."""
        ok = torch.zeros(slots.shape, dtype=torch.bool)
        for row in rows.unique().tolist():
            shared = self.ledger.shared.get(row)
            if shared is None:
                continue
            sel = (rows == row).nonzero().flatten()
            inside = sel[pos[sel] < shared.numel()]
            ok[inside] = shared[pos[inside]] == slots[inside]
        return ok

    def _check_swa_read(self, swa: torch.Tensor, full_slots: torch.Tensor, rows: torch.Tensor,
                        pos: torch.Tensor) -> None:
        owner = self.ledger.swa.owner[swa]
        ok = (swa > 0) & (owner == full_slots)
        if bool(ok.all()):
            return
        bad = (~ok).nonzero().flatten()
        freed = (swa[bad] == 0) | (owner[bad] == FREE)
        for classification, which in (("freed_slot_read", freed), ("foreign_slot_read", ~freed)):
            if bool(which.any()):
                i = int(bad[which][0])
                slot, full_slot = int(swa[i]), int(full_slots[i])
                expected = (f"the token at full slot {full_slot} ({self.ledger.request_text(int(rows[i]))} "
                            f"position {int(pos[i])})")
                if slot == 0:
                    actual = "the sink: the token's SWA side was freed or tombstoned"
                    path = self.ledger.path_text("full", full_slot, side=True)
                else:
                    actual, path = self.ledger.owner_text("swa", slot), self.ledger.path_text("swa", slot)
                self._report("kv_read", classification, "swa", slot, expected, int(which.sum()), actual, path)

    # ---- copies to the host tier ---------------------------------------------------------------------------
    def check_host_copy(self, full: torch.Tensor, swa: torch.Tensor, first_pos: int) -> torch.Tensor:
        """An offload reads the SWA side of every in-window token (`full` its full slots, `swa` the mapping's
        entries, positions from `first_pos` on). One whose SWA slot was freed while still in the window is a
        `freed_slot_read` at `kv_read` (every mode: offloads are rare), and the copy takes the sink in its
        place, so the engine goes on and the event says which code path freed it."""
        unmapped = swa <= 0
        if not bool(unmapped.any()):
            return swa
        i = int(unmapped.nonzero()[0])
        full_slot = int(full[i])
        row = int(self.ledger.full.owner[full_slot])
        whose = self.ledger.request_text(row) if row > 0 else self.ledger.owner_text("full", full_slot)
        self._report("kv_read", "freed_slot_read", "swa", 0,
                     f"the token at full slot {full_slot} ({whose} position {first_pos + i}), copied to the host tier",
                     int(unmapped.sum()), "the sink: the token's SWA side was freed or tombstoned",
                     self.ledger.path_text("full", full_slot, side=True))
        return swa.clamp(min=0)

    # ---- events -------------------------------------------------------------------------------------------
    def _report(self, site: str, classification: str, pool: str, slot: int, expected: str, count: int,
                actual: str, path: str) -> None:
        if (site, classification) in self._reported:
            return  # one event per forward, site and classification
        self._reported.add((site, classification))
        verb = "written" if site == "kv_write" else "read"
        cause = (f"{pool} slot {slot} {verb} for {expected}, but owned by {actual}; last allocated, freed or moved "
                 f"by {path}; {count} slot(s) wrong in this access")
        self.reporter.report(KeyChangeEvent(
            policy=self.policy, site=site, classification=classification, forward_id=self.forward_id,
            mode=self.forward_mode, prev_site=None, prev_forward_id=None, prev_mode=None, cause=cause, key=(),
            prev_key=None, stack=caller_stack(skip=2), slot=slot, pool=pool, expected_owner=expected,
            actual_owner=actual, last_path=path))
