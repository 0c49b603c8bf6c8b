"""KV slots in plain integers: the narrow face of the pools that the scheduler plans with.

The scheduler decides which tokens get slots, which leave the window and which request is retracted; it
never touches tensors. This adapter turns those decisions into calls on the hybrid allocator and the host
tier, and hands back Python lists.
"""

from __future__ import annotations

import torch

from runtime.mem_cache.hicache import HostKV, HostKVCache
from runtime.mem_cache.hybrid import HybridAllocator


class KVSlots:
    def __init__(self, allocator: HybridAllocator, host: HostKVCache):
        self.allocator = allocator
        self.host = host
        self.page_size = allocator.page_size
        self.full_size = allocator.full.size

    # ---- device pools ------------------------------------------------------------------------------------
    def available(self) -> int:
        """Tokens that can still get slots (both pools must hold them)."""
        return self.allocator.available_size()

    def can_extend(self, prefix_lens: list[int], seq_lens: list[int]) -> bool:
        return self.allocator.can_extend(prefix_lens, seq_lens)

    def alloc_extend(self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]) -> list[int] | None:
        """Full slots for tokens prefix..seq-1 of each request, flattened; None (nothing changed) if full."""
        locs = self.allocator.alloc_extend(prefix_lens, seq_lens, last_locs)
        return None if locs is None else locs.tolist()

    def free(self, locs: list[int]) -> None:
        self.allocator.free(torch.tensor(locs, dtype=torch.int64))

    def free_swa(self, locs: list[int]) -> int:
        """Give back the SWA side of tokens that left every window; returns SWA slots freed (page-rounded)."""
        return self.allocator.free_swa(torch.tensor(locs, dtype=torch.int64))

    def usage(self) -> dict[tuple[str, str], int]:
        """{(pool, state): tokens} for pool in full/swa and state in total/available/used."""
        out = {}
        for name, alloc in (("full", self.allocator.full), ("swa", self.allocator.swa)):
            out[name, "total"] = alloc.size
            out[name, "available"] = alloc.available_size()
            out[name, "used"] = alloc.used_size()
        return out

    def mapped_count(self) -> int:
        """Full slots that currently map to a SWA slot."""
        return int((self.allocator.full_to_swa_index_mapping[:-1] != 0).sum())

    # ---- host tier ---------------------------------------------------------------------------------------
    def can_offload(self, num_tokens: int) -> bool:
        return self.host.can_hold(num_tokens)

    def offload(self, locs: list[int], swa_from: int) -> HostKV:
        """Copy a request's KV to host memory (its device slots are freed separately, with `free`)."""
        return self.host.offload(locs, swa_from)

    def load_back(self, kv: HostKV) -> list[int] | None:
        """New full slots holding the KV again (mapping rebuilt and registered), or None if the pools are full."""
        locs = self.host.load_back(kv)
        return None if locs is None else locs.tolist()

    def drop(self, kv: HostKV) -> None:
        self.host.drop(kv)

    @property
    def host_used(self) -> int:
        return self.host.used
