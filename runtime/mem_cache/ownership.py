"""The KV ownership ledger: who owns every full and SWA slot, and which code path last changed that.

The sanitizer (`sanitizer.py`, docs/kv-sanitizer.md) checks reads and writes against it. It is fed where slots
change hands, never from the request table or the mapping it checks:

- the page allocators, when pages are taken or given back (`taken`, `given_back`): a slot is then `UNCLAIMED`
  (allocated, not yet handed to a token) or `FREE`. This is the lowest level, so a free of a partial page
  frees every slot of that page here too, whatever the caller thought it freed;
- the hybrid allocator, when a full slot is given a SWA slot (`mapped`, `remapped`): the SWA slot's owner is
  that full slot;
- the scheduler, when it hands new or loaded-back slots to a request (`claim`: the request's table row and
  the positions), and the prefix cache, when it takes a finished request's slots or loads a node back
  (`to_tree`): owner `TREE` with the positions.

Full-pool owners: a request-table row (> 0, the request while it is admitted), `TREE`, `UNCLAIMED` or `FREE`;
each slot also keeps its position. SWA-pool owners: the full slot whose token holds it, `UNCLAIMED` or `FREE`.
Each slot records the code path that last allocated, freed or moved it (the nearest caller outside the
memory plumbing, named once per call, not per slot) and the latest forward begun then; a full slot also records
the path that last gave or took its SWA side. Every update is one vectorised tensor operation per call.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch


FREE = 0
TREE = -1  # held by the prefix cache
UNCLAIMED = -2  # allocated, not yet handed to a token

# Files whose frames are plumbing between the code that decides and the allocator: a path names the caller
# outside them (`Scheduler._release_window via KVSlots.free_swa`).
_PLUMBING = tuple(os.sep + os.path.join("mem_cache", name) for name in
                  ("allocator.py", "hybrid.py", "slots.py", "ownership.py", "hicache.py", "swa_pool.py"))
_MAX_FRAMES = 8


def host_array(t: torch.Tensor | np.ndarray) -> np.ndarray:
    """The values of `t` as a numpy array: itself, a view of a CPU tensor, a copy of a GPU one (the ledger
    lives on the host whatever device the pools are on)."""
    if isinstance(t, np.ndarray):
        return t
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


def caller_path() -> str:
    """`Caller.method via Entry.method`: the nearest frame outside the memory plumbing and the plumbing call it
    made. At most a few frames are looked at (no stack walk, no source read)."""
    frame = sys._getframe(1)
    entry = None
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        code = frame.f_code
        if not code.co_filename.endswith(_PLUMBING):
            return f"{code.co_qualname} via {entry}" if entry else code.co_qualname
        entry = code.co_qualname
        frame = frame.f_back
    return entry or "unknown"


class SlotLedger:
    """One pool's slots: owner, position, last path and forward. `rows` slots, `page_size` slots a page."""

    def __init__(self, name: str, rows: int, page_size: int, ledger: "OwnershipLedger"):
        self.name = name
        self.page_size = page_size
        self.ledger = ledger
        self.owner = torch.full((rows,), FREE, dtype=torch.int64)
        self.pos = torch.full((rows,), -1, dtype=torch.int64)
        self.path = torch.zeros(rows, dtype=torch.int32)  # index into ledger.paths
        self.forward = torch.zeros(rows, dtype=torch.int64)
        # full pool only: the path and forward that last gave or took the slot's SWA side
        self.side_path = torch.zeros(rows, dtype=torch.int32)
        self.side_forward = torch.zeros(rows, dtype=torch.int64)
        # numpy views of the same memory, for the updates: a decode step writes a few slots a call, and numpy's
        # indexed assignment costs ~0.3 us where torch's costs ~1.7 (the ledger updates ~7 times a step)
        self._owner, self._pos, self._path, self._forward = (t.numpy() for t in (self.owner, self.pos, self.path,
                                                                                 self.forward))
        self._side_path, self._side_forward = self.side_path.numpy(), self.side_forward.numpy()

    def slots_of(self, pages: list[int]) -> np.ndarray:
        """The slots of `pages`, as numpy indices: the allocator calls on every step, and a few numpy
        operations cost a fraction of the torch ones on arrays this small."""
        page_a = np.array(pages, dtype=np.int64)
        if self.page_size == 1:
            return page_a
        return (page_a[:, None] * self.page_size + np.arange(self.page_size)[None, :]).reshape(-1)

    def taken(self, pages: list[int]) -> None:
        """Pages handed out by the allocator: unclaimed until a token gets them."""
        if pages:
            self.set(self.slots_of(pages), UNCLAIMED, -1, self.ledger.stamp())

    def given_back(self, pages: list[int]) -> None:
        """Pages returned to the allocator: every slot on them is free (a SWA slot's token loses its SWA side)."""
        if not pages:
            return
        slots, code = self.slots_of(pages), self.ledger.stamp()
        if self is self.ledger.swa:
            self.ledger.full.side_changed(self._owner[slots], code)
        self.set(slots, FREE, -1, code)

    def set(self, slots: torch.Tensor | np.ndarray, owner, pos, code: int) -> None:
        """`owner` and `pos`: an int for every slot, or a tensor (on any device) or array of one per slot."""
        index = host_array(slots)
        self._owner[index] = host_array(owner) if isinstance(owner, (torch.Tensor, np.ndarray)) else owner
        self._pos[index] = host_array(pos) if isinstance(pos, (torch.Tensor, np.ndarray)) else pos
        self._path[index] = code
        self._forward[index] = self.ledger.forward_id

    def side_changed(self, full_slots: torch.Tensor | np.ndarray, code: int) -> None:
        index = host_array(full_slots)
        index = index[index > 0]
        self._side_path[index] = code
        self._side_forward[index] = self.ledger.forward_id

    def clear(self) -> None:
        code = self.ledger.stamp()
        self.owner.fill_(FREE)
        self.pos.fill_(-1)
        self.path.fill_(code)
        self.forward.fill_(self.ledger.forward_id)


class OwnershipLedger:
    """The full and SWA ledgers of one hybrid allocator, the forward in progress, and the paths seen."""

    def __init__(self, full_rows: int, swa_rows: int, page_size: int):
        self.forward_id = 0  # the latest forward begun
        self.in_forward = False
        self.paths: list[str] = ["start-up"]
        self._codes: dict[str, int] = {"start-up": 0}
        self.row_labels: dict[int, str] = {}  # request-table row -> the request id that holds it
        # request-table row -> the full slots of positions 0..n-1 it reads from the prefix cache, as the cache's
        # match gave them (not as the request table says): a cache slot read by a request must be one of these
        self.shared: dict[int, torch.Tensor] = {}
        self.full = SlotLedger("full", full_rows, page_size, self)
        self.swa = SlotLedger("swa", swa_rows, page_size, self)

    def begin_forward(self, forward_id: int) -> None:
        self.forward_id, self.in_forward = forward_id, True

    def end_forward(self) -> None:
        self.in_forward = False

    def stamp(self, path: str | None = None) -> int:
        """The code of `path` (default: the caller outside the plumbing), interned."""
        path = path or caller_path()
        code = self._codes.get(path)
        if code is None:
            code = self._codes[path] = len(self.paths)
            self.paths.append(path)
        return code

    # ---- ownership moves ----------------------------------------------------------------------------------
    def mapped(self, full_locs: torch.Tensor, swa_locs: torch.Tensor) -> None:
        """Full slots `full_locs` were given the SWA slots `swa_locs` (the hybrid allocator's `_map`)."""
        code = self.stamp()
        self.swa.set(swa_locs, full_locs, -1, code)
        self.full.side_changed(full_locs, code)

    def remapped(self, mapping: torch.Tensor, rows: torch.Tensor) -> None:
        """A registered mapping changed the SWA slot of full slots `rows`: each mapped one owns its new slot."""
        rows = rows[mapping[rows] > 0]
        if rows.numel():
            self.mapped(rows, mapping[rows])  # the mapping's device; `set` takes its values to the host

    def claim(self, locs: torch.Tensor, rows: torch.Tensor | int, positions: torch.Tensor,
              labels: dict[int, str] | None = None) -> None:
        """Full slots handed to requests: `locs[i]` holds position `positions[i]` of the request in table row
        `rows[i]` (`labels`: the request id of each row, for the logs)."""
        if labels:
            self.row_labels.update(labels)
        self.full.set(locs, rows, positions, self.stamp())

    def share(self, row: int, locs: torch.Tensor) -> None:
        """The request admitted in table row `row` reads the prefix cache's slots `locs` at positions 0..n-1
        (its prefix match; empty: none)."""
        if locs.numel():
            self.shared[row] = locs
        else:
            self.shared.pop(row, None)

    def to_tree(self, locs: torch.Tensor, start: int) -> None:
        """Full slots of positions start.. now held by the prefix cache."""
        self.full.set(locs, TREE, torch.arange(start, start + locs.numel()), self.stamp())

    def clear(self) -> None:
        self.full.clear()
        self.swa.clear()

    # ---- descriptions (only when an event is reported) ----------------------------------------------------
    def owner_text(self, pool: str, slot: int) -> str:
        ledger = self.full if pool == "full" else self.swa
        owner = int(ledger.owner[slot])
        if slot < ledger.page_size:
            return "the reserved padding sink (never allocated)"
        if owner == FREE:
            return "free"
        if owner == UNCLAIMED:
            return "allocated, not handed to any token"
        if pool == "swa":
            return f"the token at full slot {owner} ({self.owner_text('full', owner)})"
        pos = int(ledger.pos[slot])
        if owner == TREE:
            return f"the prefix cache, position {pos}"
        return f"{self.request_text(owner)} position {pos}"

    def request_text(self, row: int) -> str:
        label = self.row_labels.get(row)
        return f"request {label} (row {row})" if label else f"request row {row}"

    def path_text(self, pool: str, slot: int, side: bool = False) -> str:
        """The code path that last allocated, freed or moved `slot` (`side`: that gave or took a full slot's
        SWA side), and when."""
        ledger = self.full if pool == "full" else self.swa
        code = int((ledger.side_path if side else ledger.path)[slot])
        forward = int((ledger.side_forward if side else ledger.forward)[slot])
        return f"{self.paths[code]} (forward {forward})" if forward else self.paths[code]
