"""Realistic KV-location slips, each a patch of the engine's own code (a pytest monkeypatch): the fixtures of
the KV sanitizer's tests (tests/mem_cache/test_kv_sanitizer.py, tests/diagnostics/test_sanitizer_classes.py).
Each makes a location wrong while the mapping and the translation cache agree."""

import dataclasses

import torch

from runtime.attention.base import AttentionBackend
from runtime.engine import Engine
from runtime.executor.graph_runner import StaticGraphRunner, StaticVerifyRunner
from runtime.mem_cache.hicache import HostKVCache
from runtime.mem_cache.hybrid import HybridAllocator
from runtime.mem_cache.radix_cache import RadixCache
from runtime.scheduler.scheduler import Scheduler


def padding_not_reset(mp, runner=StaticGraphRunner):
    """`load` copies the live batch but leaves the padded tail of the static buffers as the last replay left it.
    `runner`: the class whose `load` slips (StaticGraphRunner: decode, and verify too, which inherits it)."""

    def load(self, batch):
        buf = self.buffers[next(b for b in self.batch_sizes if b >= batch.batch_size)]
        n = batch.num_tokens
        buf.input_ids[:n].copy_(batch.input_ids)
        buf.positions[:n].copy_(batch.positions)
        buf.out_cache_loc[:n].copy_(batch.out_cache_loc)
        return self._static_batch(buf, batch)

    mp.setattr(runner, "load", load)


def verify_padding_not_reset(mp):
    """The verify graphs' `load` alone leaves the padded tail as the last verify replay left it."""
    padding_not_reset(mp, StaticVerifyRunner)


def fresh_rows_not_rewritten(mp):
    """`_forward_batch` writes only each request's new slots, even into a row just (re)assigned."""
    original = Engine._forward_batch

    def _forward_batch(self, batch):
        return original(self, dataclasses.replace(batch, fresh_rows=(False,) * batch.size))

    mp.setattr(Engine, "_forward_batch", _forward_batch)


def window_released_one_token_early(mp):
    """`_release_window` with the cut one past the oldest position the next query still reads."""

    def _release_window(self, reqs):
        ps = self.slots.page_size
        for r in reqs:
            if r.done:
                continue
            cut = r.cached - self.window + 2  # off by one: should be + 1
            if cut <= r.swa_released_upto:
                continue
            self.slots.free_swa(r.locs[r.swa_released_upto:cut])
            r.swa_released_upto = cut // ps * ps

    mp.setattr(Scheduler, "_release_window", _release_window)


def partial_pages_released(mp):
    """`free_swa` releases every page a token it is given sits on (and unmaps that page's tokens), not only
    whole pages: tokens of the page still inside a window lose their SWA side."""

    def free_swa(self, full_locs, site="free_swa"):
        mapping, ps = self.full_to_swa_index_mapping, self.page_size
        swa = mapping[full_locs.long()]
        swa = swa[swa > 0]
        if not swa.numel():
            return 0
        pages = torch.unique(swa // ps)
        slots = (pages[:, None] * ps + torch.arange(ps)).reshape(-1)
        rows = torch.isin(mapping[:-1], slots).nonzero().flatten()
        self.swa.free(mapping[rows])
        self.record.write(mapping, rows, 0)
        self._mutated(site, rows.numel())
        return int(rows.numel())

    mp.setattr(HybridAllocator, "free_swa", free_swa)


def locked_nodes_evictable(mp, evicted: set):
    """Eviction ignores the lock a running request holds on its cached prefix (`evicted` collects the locked
    nodes it evicts)."""

    def _evictable_leaf(self, node):
        return node is not self.root and node.on_device and not any(c.on_device for c in node.children.values())

    original = RadixCache._evict

    def _evict(self, node):
        if node.lock:
            evicted.add(node)
        original(self, node)

    mp.setattr(RadixCache, "_evictable_leaf", _evictable_leaf)
    mp.setattr(RadixCache, "_evict", _evict)


def backend_caches_swa_write_loc_by_address(mp):
    """The backend keeps the SWA write location of each write-location buffer, keyed on its address."""
    original = AttentionBackend.init_forward_metadata

    def init_forward_metadata(self, batch):
        original(self, batch)
        cache = self.__dict__.setdefault("_swa_out_by_address", {})
        key = (batch.out_cache_loc.data_ptr(), batch.out_cache_loc.numel())
        if key not in cache:
            cache[key] = self.pool.translate_loc_from_full_to_swa(batch.out_cache_loc, "attn_metadata")
        self.meta.swa_out_loc = cache[key]

    mp.setattr(AttentionBackend, "init_forward_metadata", init_forward_metadata)


def loadback_compacts_without_hooks(mp, moved: dict):
    """Before the host tier loads a request back (the pools have room), a compaction step moves the newest
    mapped token to a fresh SWA slot with a plain tensor write and frees the old one: no hooked mutation, no
    KV copy. Once per engine (its host tier) with pages of one slot (a one-slot move cannot free part of a
    page); `moved` says which slots, the last time."""
    original = HostKVCache.load_back

    def load_back(self, host):
        alloc = self.pool.allocator
        if not getattr(self, "compacted", False) and alloc.page_size == 1:
            mapping = alloc.full_to_swa_index_mapping
            mapped = (mapping[:-1] > 0).nonzero().flatten()
            page = alloc.swa.alloc(alloc.page_size) if mapped.numel() else None
            if page is not None:
                self.compacted = True
                f = int(mapped[-1])
                old = mapping[f:f + 1].clone()
                mapping[f] = page[0]
                alloc.swa.free(old)
                moved.update(full=f, swa=int(page[0]))
        return original(self, host)

    mp.setattr(HostKVCache, "load_back", load_back)
