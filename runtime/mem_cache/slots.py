"""KV slots in plain integers: the narrow face of the pools that the scheduler plans with.

The scheduler decides which tokens get slots, which leave the window, which request is retracted and what
is cached; it never touches tensors. This adapter turns those decisions into calls on the hybrid allocator,
the host tier and the prefix cache, and hands back Python lists.

With the prefix cache on, the tree's unlocked nodes count as available: an allocation that does not fit the
free slots first evicts them (least recently used first), so the scheduler plans as if they were free.
"""

from __future__ import annotations

from runtime.int_tensors import int_tensor
from runtime.mem_cache.hicache import HostKV, HostKVCache
from runtime.mem_cache.hybrid import HybridAllocator
from runtime.mem_cache.radix_cache import PrefixMatch, RadixCache
from telemetry.stats import PrefixCacheStats


class KVSlots:
    def __init__(self, allocator: HybridAllocator, host: HostKVCache, *, prefix_cache: bool = False,
                 window: int | None = None, stats: PrefixCacheStats | None = None):
        """`prefix_cache`: keep finished requests' KV in a radix tree (`window`: the model's sliding window,
        None without sliding layers; `stats`: where the tree keeps its numbers)."""
        self.allocator = allocator
        self.host = host
        self.page_size = allocator.page_size
        self.full_size = allocator.full.size
        self.tree = RadixCache(self, self.page_size, window, stats) if prefix_cache else None

    # ---- device pools ------------------------------------------------------------------------------------
    def available(self) -> int:
        """Tokens that can still get slots (both pools must hold them), counting what eviction can free."""
        full, swa = self.free_tokens()
        if self.tree is not None:
            evict_full, evict_swa = self.tree.evictable()
            full, swa = full + evict_full, swa + evict_swa
        return min(full, swa)

    def free_tokens(self) -> tuple[int, int]:
        """Free slots now in the (full, SWA) pool."""
        return self.allocator.full.available_size(), self.allocator.swa.available_size()

    def can_extend(self, prefix_lens: list[int], seq_lens: list[int]) -> bool:
        if self.allocator.can_extend(prefix_lens, seq_lens):
            return True
        if self.tree is None:
            return False
        need = self.allocator.full.pages_needed_extend(prefix_lens, seq_lens) * self.page_size
        self.tree.make_room(need, need)
        return self.allocator.can_extend(prefix_lens, seq_lens)

    def alloc_extend(self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]) -> list[int] | None:
        """Full slots for tokens prefix..seq-1 of each request, flattened; None (nothing changed) if full."""
        if not self.can_extend(prefix_lens, seq_lens):
            return None
        locs = self.allocator.alloc_extend(prefix_lens, seq_lens, last_locs)
        return None if locs is None else locs.tolist()

    # ---- ownership (the KV sanitizer's ledger; nothing to do without it) -----------------------------------
    def claim(self, locs: list[int], rows: list[int], positions: list[int], labels: dict[int, str]) -> None:
        """Hand slots to requests: `locs[i]` holds position `positions[i]` of the request in table row
        `rows[i]` (`labels`: row -> request id, for the logs). One ledger update for the whole batch."""
        ledger = self.allocator.ledger
        if ledger is not None and locs:
            ledger.claim(int_tensor(locs), int_tensor(rows), int_tensor(positions), labels)

    def share(self, row: int, locs: list[int]) -> None:
        """The request in table row `row` reads the cached prefix `locs` (its match; [] for none)."""
        ledger = self.allocator.ledger
        if ledger is not None:
            ledger.share(row, int_tensor(locs))

    def to_tree(self, locs: list[int], start: int) -> None:
        """The prefix cache now holds the full slots of positions start.. (`locs`)."""
        ledger = self.allocator.ledger
        if ledger is not None and locs:
            ledger.to_tree(int_tensor(locs), start)

    def free(self, locs: list[int], site: str = "free") -> None:
        if locs:
            self.allocator.free(int_tensor(locs), site=site)

    def unmap(self, locs: list[int], site: str) -> None:
        """Clear the full->SWA mapping of tokens whose slots stay held (see HybridAllocator.clear_swa_mapping)."""
        if locs:
            self.allocator.clear_swa_mapping(int_tensor(locs), site=site)

    def free_swa(self, locs: list[int], site: str = "free_swa") -> int:
        """Give back the SWA side of tokens that left every window; returns SWA slots freed (page-rounded)."""
        if not locs:
            return 0
        return self.allocator.free_swa(int_tensor(locs), site=site)

    def usage(self) -> dict[tuple[str, str], int]:
        """{(pool, state): tokens} for pool in full/swa and state in total/available/used. The prefix cache's
        unlocked nodes count as available (eviction frees them on demand), not as used."""
        spare_full, spare_swa = self.tree.evictable() if self.tree is not None else (0, 0)
        out = {}
        for name, alloc, spare in (("full", self.allocator.full, spare_full), ("swa", self.allocator.swa, spare_swa)):
            out[name, "total"] = alloc.size
            out[name, "available"] = alloc.available_size() + spare
            out[name, "used"] = alloc.used_size() - spare
        return out

    def mapped_count(self) -> int:
        """Full slots that currently map to a SWA slot."""
        return int((self.allocator.full_to_swa_index_mapping[:-1] != 0).sum())

    # ---- prefix cache ------------------------------------------------------------------------------------
    def match_prefix(self, ids: list[int], limit: int) -> PrefixMatch | None:
        """The longest usable cached prefix of `ids` (at most `limit` tokens), held until released; None
        when the prefix cache is off."""
        return None if self.tree is None else self.tree.match(ids, limit)

    def release_prefix(self, match: PrefixMatch) -> None:
        self.tree.release(match)

    def cache_prefix(self, ids: list[int], locs: list[int], match: PrefixMatch | None, swa_from: int) -> None:
        """Hand a finished request's KV to the tree (see `RadixCache.insert`) and release its hold, if any."""
        self.tree.insert(ids, locs, match if match is not None else self.tree.empty, swa_from)

    def clear_prefix_cache(self) -> None:
        if self.tree is not None:
            self.tree.clear()

    # ---- host tier ---------------------------------------------------------------------------------------
    def can_offload(self, num_tokens: int) -> bool:
        return self.host.can_hold(num_tokens)

    def offload(self, locs: list[int], swa_from: int) -> HostKV:
        """Copy a request's KV to host memory (its device slots are freed separately, with `free`)."""
        return self.host.offload(locs, swa_from)

    def load_back(self, kv: HostKV, headroom: int = 0) -> list[int] | None:
        """New full slots holding the KV again (mapping rebuilt and registered), or None (nothing changed)
        unless both pools can hold it plus `headroom` more tokens (room to go on, e.g. one decode step)."""
        ps = self.page_size
        full = -(-kv.num_tokens // ps) * ps + headroom
        swa = -(-(kv.num_tokens - kv.swa_from) // ps) * ps + headroom
        if self.tree is not None:
            self.tree.make_room(full, swa)
        free_full, free_swa = self.free_tokens()
        if free_full < full or free_swa < swa:
            return None
        locs = self.host.load_back(kv)
        return None if locs is None else locs.tolist()

    def drop(self, kv: HostKV) -> None:
        self.host.drop(kv)

    @property
    def host_used(self) -> int:
        return self.host.used

    # what the prefix cache asks of the host tier (`radix_cache.KVStore`)
    def host_can_hold(self, num_tokens: int) -> bool:
        return self.host.can_hold(num_tokens)

    def node_to_host(self, locs: list[int], with_swa: bool) -> HostKV:
        return self.host.offload(locs, 0 if with_swa else len(locs))

    def node_from_host(self, kv: HostKV) -> list[int] | None:
        locs = self.host.restore(kv)
        return None if locs is None else locs.tolist()

    def register_loadback(self) -> None:
        self.host.register("prefix_loadback")
