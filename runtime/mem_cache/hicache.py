"""Host tier for KV: offload a request's KV to host memory under pressure, load it back into new slots.

Full layers keep every token; sliding layers keep only the tokens still inside the window (their older SWA
slots were already given back). Load-back allocates new slots, copies the KV in, rebuilds the full→SWA
mapping for the new slots and re-registers it, which invalidates every cache derived from the old mapping.
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


class HostKVCache:
    """A budget of `capacity` tokens of host memory (0 disables offloading)."""

    def __init__(self, pool, capacity: int):
        self.pool = pool  # HybridKVPool
        self.capacity = capacity
        self.used = 0

    def can_hold(self, num_tokens: int) -> bool:
        return self.used + num_tokens <= self.capacity

    def offload(self, locs: list[int], swa_from: int) -> HostKV:
        """Copy the KV of a request's tokens (full slots `locs`, positions 0..n-1) to host memory."""
        full = torch.tensor(locs, dtype=torch.int64)
        swa = self.pool.allocator.full_to_swa_index_mapping[full[swa_from:]]
        if bool((swa <= 0).any()):
            raise RuntimeError("offload: an in-window token has no SWA slot")
        full_k, full_v = self.pool.full_pool.copy_to_host(full)
        swa_k, swa_v = self.pool.swa_pool.copy_to_host(swa)
        host = HostKV(num_tokens=len(locs), swa_from=swa_from, full_k=full_k, full_v=full_v, swa_k=swa_k, swa_v=swa_v)
        self.used += host.num_tokens
        return host

    def load_back(self, host: HostKV) -> torch.Tensor | None:
        """New full slots holding the request's KV again, or None (nothing changed) if the pools are full."""
        alloc = self.pool.allocator
        full = alloc.alloc_window(host.num_tokens, host.swa_from)
        if full is None:
            return None
        swa = alloc.full_to_swa_index_mapping[full[host.swa_from:]]
        self.pool.full_pool.copy_from_host(full, host.full_k, host.full_v)
        self.pool.swa_pool.copy_from_host(swa, host.swa_k, host.swa_v)
        # The engine's mapping is rebuilt for the new slots and registered anew: every derived cache
        # (memo entry, layerwise location) must forget the old one.
        self.pool.register_mapping(alloc.full_to_swa_index_mapping.clone())
        self.used -= host.num_tokens
        return full

    def drop(self, host: HostKV) -> None:
        self.used -= host.num_tokens
