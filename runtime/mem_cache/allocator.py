"""Slot allocator for one KV pool, page_size 1 or paged.

A pool of `size` usable slots is laid out as pages of `page_size` slots; page 0 (slots 0..page_size-1) is
reserved as a padding sink, so usable slots are `page_size .. size + page_size - 1` and buffers hold
`size + page_size` rows. With page_size 1 a page is a slot. Every page is either free or held; freeing a page
that is not held is an error (a double free silently corrupts two requests later), as is any location outside
the pool. The allocator is plain CPU bookkeeping; the locations it returns live on `device`.
"""

from __future__ import annotations

from collections import deque

import torch

from runtime.int_tensors import SMALL, bounds, int_tensor
from runtime.mem_cache.paths import PAGED_ALLOCATOR_PATHS


class AllocationError(RuntimeError):
    """Raised on misuse (double free, bad location); a failed alloc returns None instead."""


class PagedAllocator:
    def __init__(self, size: int, page_size: int = 1, device: str | torch.device = "cpu"):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < page_size or size % page_size:
            raise ValueError(f"pool size {size} must be a positive multiple of page_size {page_size}")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = torch.device(device)
        self.path_counts = dict.fromkeys(PAGED_ALLOCATOR_PATHS, 0)  # runtime/mem_cache/paths.py
        self.ledger = None  # the pool's SlotLedger (ownership.py) when the KV sanitizer is on
        self.clear()

    # ---- state -------------------------------------------------------------------------------------------
    def clear(self) -> None:
        """Return every page to the free list (pages 1..num_pages, in order)."""
        # first in, first out; a deque, because slicing a list of every free page cost ~0.7 ms per allocation
        self._free_pages: deque[int] = deque(range(1, self.num_pages + 1))
        self._held = bytearray(self.num_pages + 1)  # _held[p] == 1 while page p is allocated

    def available_size(self) -> int:
        return len(self._free_pages) * self.page_size

    def free_page_count(self) -> int:
        return len(self._free_pages)

    def used_size(self) -> int:
        return self.size - self.available_size()

    def pages_needed_extend(self, prefix_lens: list[int], seq_lens: list[int]) -> int:
        """New pages that tokens prefix_len..seq_len-1 of each request need, continuing their last page."""
        ps = self.page_size
        total = 0
        for p, s in zip(prefix_lens, seq_lens):
            if s < p:
                raise ValueError(f"seq_len {s} < prefix_len {p}")
            total += -(-s // ps) - -(-p // ps)
        return total

    # ---- allocation --------------------------------------------------------------------------------------
    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` fresh slots (n must be a multiple of page_size), or None if the pool cannot hold them."""
        if n < 0 or n % self.page_size:
            raise ValueError(f"alloc of {n} slots: must be a non-negative multiple of page_size {self.page_size}")
        pages = self._take_pages(n // self.page_size)
        if pages is None:
            return None
        return self._slots_of_pages(pages)

    def alloc_extend(self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        """Slots for tokens prefix_len..seq_len-1 of each request, filling each request's last partial page
        first (its last token sits at `last_loc`, -1 when the request has no token yet). All or nothing."""
        if not (len(prefix_lens) == len(seq_lens) == len(last_locs)):
            raise ValueError("prefix_lens, seq_lens and last_locs must have the same length")
        pages = self._take_pages(self.pages_needed_extend(prefix_lens, seq_lens))
        if pages is None:
            return None
        ps, out, next_page = self.page_size, [], iter(pages)
        for p, s, last in zip(prefix_lens, seq_lens, last_locs):
            if p % ps:
                if last < ps:
                    self._give_back(pages)
                    raise AllocationError(f"prefix of {p} tokens ends mid-page but last_loc is {last}")
                fill = min(s, -(-p // ps) * ps) - p  # slots left on the request's current page
                self.path_counts["alloc_partial_page"] += 1
                out.extend(range(last + 1, last + 1 + fill))
                p += fill
            while p < s:
                base = next(next_page) * ps
                take = min(ps, s - p)
                out.extend(range(base, base + take))
                p += take
        return int_tensor(out, device=self.device)

    def alloc_decode(self, seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        """One slot per request for the token at position seq_len-1 (seq_lens include the new token)."""
        return self.alloc_extend([s - 1 for s in seq_lens], seq_lens, last_locs)

    def free(self, locs: torch.Tensor) -> None:
        """Release the pages holding `locs`. Every page must be held; nothing changes on error."""
        self._give_back(self.check_held(locs))

    def check_held(self, locs: torch.Tensor) -> list[int]:
        """The pages of `locs`, validated: raise AllocationError (a double free) unless every one is held."""
        pages = self._pages_of(locs)
        for p in pages:
            if not self._held[p]:
                raise AllocationError(f"double free: page {p} (slot {p * self.page_size}) is not allocated")
        return pages

    def is_held(self, locs: torch.Tensor) -> torch.Tensor:
        """Bool per location: is its page currently allocated."""
        held = torch.tensor(list(self._held), dtype=torch.bool)
        return held[locs.cpu().long() // self.page_size]

    # ---- internals ---------------------------------------------------------------------------------------
    def _take_pages(self, n: int) -> list[int] | None:
        if n > len(self._free_pages):
            return None
        pages = [self._free_pages.popleft() for _ in range(n)]
        for p in pages:
            self._held[p] = 1
        if self.ledger is not None:
            self.ledger.taken(pages)
        return pages

    def _give_back(self, pages: list[int]) -> None:
        for p in pages:
            self._held[p] = 0
        self._free_pages.extend(pages)
        if self.ledger is not None:
            self.ledger.given_back(pages)

    def _slots_of_pages(self, pages: list[int]) -> torch.Tensor:
        ps = self.page_size
        page_t = int_tensor(pages)
        slots = (page_t[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)
        return slots.to(self.device)

    def _pages_of(self, locs: torch.Tensor) -> list[int]:
        """Validated, de-duplicated pages of `locs` (sorted)."""
        check_locations(locs, self.size + self.page_size, allow_reserved=False, page_size=self.page_size)
        if locs.numel() <= SMALL:  # a decode step's few slots: the division in Python, not a torch operation
            ps = self.page_size
            return sorted({v // ps for v in locs.reshape(-1).tolist()})
        return sorted(set((locs.cpu() // self.page_size).tolist()))


def check_locations(locs: torch.Tensor, num_rows: int, *, allow_reserved: bool, page_size: int = 1) -> None:
    """Raise a clear error for a location tensor that is not an integer tensor of in-range slots."""
    if not isinstance(locs, torch.Tensor):
        raise TypeError(f"locations must be a torch.Tensor, got {type(locs).__name__}")
    if locs.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"locations must be int32 or int64, got {locs.dtype}")
    if locs.numel() == 0:
        return
    lo, hi = bounds(locs)
    first = 0 if allow_reserved else page_size
    if lo < first or hi >= num_rows:
        raise IndexError(f"location out of range: min {lo}, max {hi}, valid {first}..{num_rows - 1}")
