"""Hybrid allocator: a full pool, a SWA pool, and the full→SWA index mapping that links them.

Every token owns a full slot; while it is inside some request's sliding window it also owns a SWA slot, and
`full_to_swa_index_mapping[full_slot]` names it (0 = unmapped). The mapping carries one trailing sentinel
`-1`, so translating the location `-1` ("no previous token") yields `-1`.

Every mutation of the mapping calls the registered invalidation hook with its site name, so the pool's
translation cache can never outlive the mapping it was computed from (the pool's `skip-alloc-invalidation`
fault switch ignores exactly these calls, to show that the version guard still catches it). Each mutation
also writes `record`, so that a write by any other path is found and reported as unhooked.
"""

from __future__ import annotations

from typing import Callable

import torch

from runtime.int_tensors import int_tensor
from runtime.mem_cache.allocator import AllocationError, PagedAllocator, check_locations
from runtime.mem_cache.mapping_record import MappingRecord
from runtime.mem_cache.paths import HYBRID_ALLOCATOR_PATHS
from runtime.mem_cache.ownership import OwnershipLedger

InvalidateHook = Callable[[str], None]


class HybridAllocator:
    def __init__(self, full_size: int, swa_size: int, page_size: int = 1, device: str | torch.device = "cpu",
                 ownership: bool = False):
        """`ownership`: keep the KV sanitizer's ledger of who owns every slot (`self.ledger`, else None)."""
        self.page_size = page_size
        self.device = torch.device(device)
        self.full = PagedAllocator(full_size, page_size, device)
        self.swa = PagedAllocator(swa_size, page_size, device)
        self.full_rows = full_size + page_size
        self.swa_rows = swa_size + page_size
        # (full_rows + 1,) int64; the last element is the -1 sentinel.
        self.full_to_swa_index_mapping = self._empty_mapping()
        self.record = MappingRecord(self.full_to_swa_index_mapping)  # what the hooked mutations wrote
        self.mapping_generation = 0  # bumped when a new mapping tensor is registered
        self.last_mutation: str | None = None  # site of the latest mapping mutation, for attributing staleness
        self.last_mutation_rows = 0  # rows of the mapping it wrote
        self._invalidate_hooks: list[InvalidateHook] = []
        self.path_counts = dict.fromkeys(HYBRID_ALLOCATOR_PATHS, 0)  # runtime/mem_cache/paths.py
        self.ledger = OwnershipLedger(self.full_rows, self.swa_rows, page_size) if ownership else None
        if self.ledger is not None:
            self.full.ledger, self.swa.ledger = self.ledger.full, self.ledger.swa

    def add_invalidate_hook(self, hook: InvalidateHook) -> None:
        self._invalidate_hooks.append(hook)

    def _mutated(self, site: str, rows: int) -> None:
        self.last_mutation, self.last_mutation_rows = site, rows
        for hook in self._invalidate_hooks:
            hook(site)

    def _empty_mapping(self) -> torch.Tensor:
        mapping = torch.zeros(self.full_rows + 1, dtype=torch.int64, device=self.device)
        mapping[-1] = -1
        return mapping

    # ---- sizes -------------------------------------------------------------------------------------------
    def available_size(self) -> int:
        """Tokens that can still be admitted: both pools must hold them."""
        return min(self.full.available_size(), self.swa.available_size())

    def can_extend(self, prefix_lens: list[int], seq_lens: list[int]) -> bool:
        need = self.full.pages_needed_extend(prefix_lens, seq_lens)
        return need <= self.full.free_page_count() and need <= self.swa.free_page_count()

    # ---- allocation (all or nothing: both pools are checked before either is touched) -------------------
    def alloc(self, n: int) -> torch.Tensor | None:
        if n // self.page_size > min(self.full.free_page_count(), self.swa.free_page_count()):
            return None
        full_locs = self.full.alloc(n)
        swa_locs = self.swa.alloc(n)
        assert full_locs is not None and swa_locs is not None  # guaranteed by the check above
        self._map(full_locs, swa_locs)
        return full_locs

    def alloc_extend(self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        """Full locations for tokens prefix_len..seq_len-1 of each request; SWA slots follow the same page
        layout, continuing from the SWA slot of each request's last token (found through the mapping)."""
        if not self.can_extend(prefix_lens, seq_lens):
            return None
        swa_last = self.full_to_swa_index_mapping[int_tensor(last_locs)].tolist()
        for p, last, swa in zip(prefix_lens, last_locs, swa_last):
            if p % self.page_size and swa <= 0:
                raise AllocationError(f"token at full slot {last} lost its SWA slot mid-page")
        full_locs = self.full.alloc_extend(prefix_lens, seq_lens, last_locs)
        swa_locs = self.swa.alloc_extend(prefix_lens, seq_lens, swa_last)
        assert full_locs is not None and swa_locs is not None
        self._map(full_locs, swa_locs)
        return full_locs

    def alloc_decode(self, seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        return self.alloc_extend([s - 1 for s in seq_lens], seq_lens, last_locs)

    def alloc_window(self, n: int, swa_from: int) -> torch.Tensor | None:
        """Full slots for positions 0..n-1 of one request but SWA slots only for positions swa_from..n-1
        (swa_from page-aligned): what a host-cache load-back needs. All or nothing."""
        ps = self.page_size
        if swa_from % ps or not 0 <= swa_from <= n:
            raise ValueError(f"swa_from {swa_from} must be page-aligned and within 0..{n}")
        if -(-n // ps) > self.full.free_page_count() or -(-(n - swa_from) // ps) > self.swa.free_page_count():
            return None
        full_locs = self.full.alloc_extend([0], [n], [-1])
        swa_locs = self.swa.alloc_extend([swa_from], [n], [-1])
        assert full_locs is not None and swa_locs is not None
        self._map(full_locs[swa_from:], swa_locs)
        self.path_counts["alloc_window"] += 1
        return full_locs

    def _map(self, full_locs: torch.Tensor, swa_locs: torch.Tensor) -> None:
        self.record.write(self.full_to_swa_index_mapping, full_locs, swa_locs)
        if self.ledger is not None:
            self.ledger.mapped(full_locs, swa_locs)
        self._mutated("alloc", full_locs.numel())

    # ---- release -----------------------------------------------------------------------------------------
    def free(self, full_locs: torch.Tensor, site: str = "free") -> None:
        """Release tokens entirely: their SWA slots (where still mapped) and their full slots. `site` names
        the caller's invalidation site (the prefix cache's eviction says `prefix_evict`)."""
        self.full.check_held(full_locs)  # all or nothing: validate both sides before touching either
        swa_locs = self.full_to_swa_index_mapping[full_locs.long()]
        swa_locs = swa_locs[swa_locs > 0]
        self.swa.free(swa_locs)  # validates before touching anything
        self.full.free(full_locs)
        self.record.write(self.full_to_swa_index_mapping, full_locs.long(), 0)
        self._mutated(site, full_locs.numel())

    def free_swa(self, full_locs: torch.Tensor, site: str = "free_swa") -> int:
        """Release only the SWA side of tokens that left the window. Page-rounded: a SWA page is freed only
        when every token on it is among `full_locs`; the rest stay mapped. Returns SWA slots freed. `site`
        as for `free` (the prefix cache's tombstones say `prefix_tombstone`)."""
        check_locations(full_locs, self.full_rows, allow_reserved=False, page_size=self.page_size)
        full_locs = full_locs.long().to(self.device)  # masked below by the mapping's values: one device
        swa_locs = self.full_to_swa_index_mapping[full_locs]
        mapped = swa_locs > 0
        if not bool(mapped.all()):  # usually every one is mapped: no masking then
            full_locs, swa_locs = full_locs[mapped], swa_locs[mapped]
        if swa_locs.numel() == 0:
            return 0
        ps = self.page_size
        if ps > 1:
            pages, counts = torch.unique(swa_locs // ps, return_counts=True)
            whole = pages[counts == ps]
            keep = torch.isin(swa_locs // ps, whole)
            self.path_counts["free_swa_page_kept"] += int(not bool(keep.all()))
            full_locs, swa_locs = full_locs[keep], swa_locs[keep]
            if swa_locs.numel() == 0:
                return 0
        self.swa.free(swa_locs)
        self.record.write(self.full_to_swa_index_mapping, full_locs, 0)
        self._mutated(site, full_locs.numel())
        return int(swa_locs.numel())

    def clear(self) -> None:
        self.full.clear()
        self.swa.clear()
        if self.ledger is not None:
            self.ledger.clear()
        self.record.reset(self.full_to_swa_index_mapping)
        self._mutated("clear", self.full_rows)

    # ---- direct mapping edits (host-cache load-back) -----------------------------------------------------
    def set_full_to_swa_mapping(self, full_locs: torch.Tensor, swa_locs: torch.Tensor) -> None:
        check_locations(full_locs, self.full_rows, allow_reserved=False, page_size=self.page_size)
        check_locations(swa_locs, self.swa_rows, allow_reserved=False, page_size=self.page_size)
        if full_locs.shape != swa_locs.shape:
            raise ValueError(f"mapping update shapes differ: {tuple(full_locs.shape)} vs {tuple(swa_locs.shape)}")
        self.record.write(self.full_to_swa_index_mapping, full_locs.long(), swa_locs.long())
        self.path_counts["set_mapping"] += 1
        if self.ledger is not None:
            self.ledger.mapped(full_locs.long(), swa_locs.long())
        self._mutated("set_mapping", full_locs.numel())

    def clear_swa_mapping(self, full_locs: torch.Tensor, site: str = "clear_swa_mapping") -> None:
        """Unmap tokens whose SWA slots stay held (on a page other tokens still use), e.g. rolled-back draft
        tokens at the end of a request's last page: the page is written again by the next step."""
        check_locations(full_locs, self.full_rows, allow_reserved=False, page_size=self.page_size)
        self.record.write(self.full_to_swa_index_mapping, full_locs.long(), 0)
        self._mutated(site, full_locs.numel())

    def register_mapping(self, mapping: torch.Tensor, site: str = "register_mapping") -> None:
        """Adopt a rebuilt mapping tensor (host-cache load-back rebuilds it). A new tensor starts a new
        version history, so the generation counter is what tells a guard that the mapping was swapped.
        `site`: the prefix cache's load-back says `prefix_loadback`."""
        self.check_mapping(mapping)
        if self.ledger is not None:  # the rows the rebuild moves own their new SWA slots; an unhooked write in the
            # current mapping is no rebuild of this load-back's: the ledger keeps it foreign
            current = self.full_to_swa_index_mapping
            self.ledger.remapped(mapping, (mapping[:-1] != current[:-1]).nonzero().flatten())
        self.full_to_swa_index_mapping = mapping
        self.record.adopt(mapping)
        self.mapping_generation += 1
        self.path_counts["register_mapping"] += 1
        self._mutated(site, self.full_rows)

    def check_mapping(self, mapping: torch.Tensor) -> None:
        """Raise unless `mapping` could serve as this allocator's full→SWA mapping."""
        if not isinstance(mapping, torch.Tensor) or mapping.dtype != torch.int64:
            raise TypeError(f"mapping must be an int64 tensor, got {getattr(mapping, 'dtype', type(mapping))}")
        if mapping.shape != (self.full_rows + 1,):
            raise ValueError(f"mapping must have shape ({self.full_rows + 1},), got {tuple(mapping.shape)}")
        if int(mapping[-1]) != -1:
            raise ValueError("mapping must end with the -1 sentinel")
