"""Host tier for KV: copies of device KV in host memory, loaded back into new slots when needed again.

Two users: the scheduler offloads a retracted request's KV under pool pressure, and the prefix cache evicts
its least recently used nodes here instead of dropping them. Full layers keep every token; sliding layers keep
only the tokens still inside the window (their older SWA slots were already given back), so a copy carries
SWA rows from `swa_from` on.

Load-back allocates new slots, copies the KV in, rebuilds the full→SWA mapping for the new slots and
registers it, which invalidates every cache derived from the old mapping. A request's load-back registers
under `register_mapping`; the prefix cache restores several nodes and registers once, under
`prefix_loadback`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HostKV:
    num_tokens: int
    swa_from: int  # first position whose sliding-layer KV was kept
    full_k: list[torch.Tensor]  # per full layer: (num_tokens, Hkv, D)
    full_v: list[torch.Tensor]
    swa_k: list[torch.Tensor]  # per sliding layer: (num_tokens - swa_from, Hkv, D)
    swa_v: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.full_k, *self.full_v, *self.swa_k, *self.swa_v))

    def split(self, k: int) -> tuple["HostKV", "HostKV"]:
        """Positions 0..k-1 and k..n-1 as two copies (views: tokens and bytes add up to this one's)."""

        def part(lo: int, hi: int) -> HostKV:
            s_lo, s_hi = max(lo - self.swa_from, 0), max(hi - self.swa_from, 0)  # SWA row r: position swa_from + r
            return HostKV(num_tokens=hi - lo, swa_from=min(max(self.swa_from - lo, 0), hi - lo),
                          full_k=[t[lo:hi] for t in self.full_k], full_v=[t[lo:hi] for t in self.full_v],
                          swa_k=[t[s_lo:s_hi] for t in self.swa_k], swa_v=[t[s_lo:s_hi] for t in self.swa_v])

        return part(0, k), part(k, self.num_tokens)


class HostKVCache:
    """A budget of `capacity` tokens of host memory (0 disables the tier). `used` counts tokens held,
    `used_bytes` their bytes; `stats` (EngineStats, optional) counts the bytes moved in each direction."""

    def __init__(self, pool, capacity: int, stats=None):
        self.pool = pool  # HybridKVPool
        self.capacity = capacity
        self.stats = stats
        self.used = 0
        self.used_bytes = 0

    def can_hold(self, num_tokens: int) -> bool:
        return self.used + num_tokens <= self.capacity

    def offload(self, locs: list[int], swa_from: int) -> HostKV:
        """Copy the KV of tokens at full slots `locs` (positions 0..n-1 of the copy) to host memory; sliding
        layers from position `swa_from` on, whose tokens must all be mapped."""
        full = torch.tensor(locs, dtype=torch.int64)
        swa = self.pool.allocator.full_to_swa_index_mapping[full[swa_from:]]
        swa = self.pool.sanitizer.check_host_copy(full[swa_from:], swa, swa_from)  # each in-window token mapped
        full_k, full_v = self.pool.full_pool.copy_to_host(full)
        swa_k, swa_v = self.pool.swa_pool.copy_to_host(swa)
        host = HostKV(num_tokens=len(locs), swa_from=swa_from, full_k=full_k, full_v=full_v, swa_k=swa_k, swa_v=swa_v)
        self.used += host.num_tokens
        self.used_bytes += host.nbytes
        if self.stats is not None:
            self.stats.add_hicache_bytes("offload", host.nbytes)
        return host

    def restore(self, host: HostKV) -> torch.Tensor | None:
        """New full slots holding the KV again, SWA slots mapped from `swa_from` on, or None (nothing
        changed) if the pools are full. The caller registers the rebuilt mapping (`register`)."""
        alloc = self.pool.allocator
        full = alloc.alloc_window(host.num_tokens, host.swa_from)
        if full is None:
            return None
        swa = alloc.full_to_swa_index_mapping[full[host.swa_from:]]
        self.pool.full_pool.copy_from_host(full, host.full_k, host.full_v)
        self.pool.swa_pool.copy_from_host(swa, host.swa_k, host.swa_v)
        self.drop(host)
        if self.stats is not None:
            self.stats.add_hicache_bytes("loadback", host.nbytes)
        return full

    def register(self, site: str) -> None:
        """Register a rebuilt mapping for the slots restored since: every derived cache (memo entry,
        layerwise location) must forget the old one."""
        self.pool.register_mapping(self.pool.allocator.full_to_swa_index_mapping.clone(), site=site)

    def load_back(self, host: HostKV) -> torch.Tensor | None:
        """A retracted request's KV in new full slots, mapping registered; None (nothing changed) if full."""
        full = self.restore(host)
        if full is not None:
            self.register("register_mapping")
        return full

    def drop(self, host: HostKV) -> None:
        self.used -= host.num_tokens
        self.used_bytes -= host.nbytes
