"""Prefix cache for hybrid SWA models: a radix tree of cached token prefixes, in slot integers.

A node owns the full-pool slots of its tokens (an edge of the tree: `key` token ids, `locs` full slots) and,
only where a later request can read them, their SWA slots. A request that reuses a cached prefix of length q
prefills from position q, and its first query sees positions q-W+1..q on sliding layers: so a prefix is
usable only when the SWA side of its last W-1 tokens is alive. When a request's KV is inserted, the tree keeps
SWA for the last window of the inserted key and tombstones the rest (a node whose `swa` is False holds full
KV only: it still serves longer prefixes that pass through it). Under SWA pressure the least recently used
windows are tombstoned too.

Lock counts: a running request holds its matched node locked, which protects the node and every ancestor
from eviction (both pools). Eviction is LRU: unlocked device leaves go to the host tier when it has room
(their KV copied, their device slots freed) or are dropped; a later match that walks into host nodes loads
them back into new slots and registers the rebuilt mapping once. Host nodes hang below device nodes, never
above. With page_size > 1 every key, match and split is page-aligned, so that no page is shared between the
tree and a request extending it.

Every device effect goes through `KVStore` (the pools and the host tier in slot integers), whose frees are
the allocator's hooked mutations: `prefix_evict` (a node's slots freed under pressure), `prefix_tombstone`
(a node's SWA side freed) and `prefix_loadback` (the rebuilt mapping registered). Nothing here writes the
mapping. Not thread-safe: the engine's thread calls everything; a scrape reads only the stats' plain ints.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Iterator, Protocol

from runtime.mem_cache.paths import PREFIX_CACHE_PATHS
from telemetry.stats import PrefixCacheStats


class KVStore(Protocol):
    """What the tree asks of the pools and the host tier (implemented by `KVSlots`)."""

    def free_tokens(self) -> tuple[int, int]:
        """Tokens that can be allocated now in the (full, SWA) pool."""

    def free(self, locs: list[int], site: str = "free") -> None:
        """Release tokens entirely (full slots and any mapped SWA slots)."""

    def free_swa(self, locs: list[int], site: str = "free_swa") -> int:
        """Release only the SWA side of tokens; returns SWA slots freed."""

    def host_can_hold(self, num_tokens: int) -> bool: ...

    def node_to_host(self, locs: list[int], with_swa: bool): ...

    def node_from_host(self, host) -> list[int] | None:
        """New full slots with the KV restored (SWA mapped if the copy has it), or None if the pools are full."""

    def drop(self, host) -> None: ...

    def register_loadback(self) -> None:
        """Register the rebuilt mapping after restores (invalidates every derived translation cache)."""

    def to_tree(self, locs: list[int], start: int) -> None:
        """The tree now holds the full slots `locs` of positions start.. (the KV sanitizer's ownership ledger)."""


class Node:
    __slots__ = ("key", "locs", "swa", "host", "parent", "children", "lock", "last_access")

    def __init__(self, key: list[int], locs: list[int] | None, swa: bool, parent: "Node | None", host=None):
        self.key = key  # token ids of this edge
        self.locs = locs  # their full slots while on the device, else None
        self.swa = swa  # SWA side kept (mapped on the device, or copied with the host copy)
        self.host = host  # HostKV while on the host tier
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.lock = 0
        self.last_access = 0

    @property
    def on_device(self) -> bool:
        return self.host is None

    def __repr__(self) -> str:
        where = "device" if self.on_device else "host"
        return f"Node({len(self.key)} tokens, {where}, swa={self.swa}, lock={self.lock})"


@dataclass(frozen=True)
class PrefixMatch:
    """A cached prefix held for a request: `locs` are the full slots of positions 0..length-1, owned by the
    tree, and `node` (the deepest node of the prefix) is locked until released."""

    node: Node
    length: int
    locs: tuple[int, ...]


class RadixCache:
    def __init__(self, store: KVStore, page_size: int, window: int | None, stats: PrefixCacheStats | None = None):
        self.store = store
        self.page_size = page_size
        self.window = window  # None: a model without sliding layers needs SWA for every position
        self.stats = stats if stats is not None else PrefixCacheStats()
        self.root = Node([], [], True, None)
        self.root.lock = 1  # never evicted
        self.empty = PrefixMatch(self.root, 0, ())
        self._clock = itertools.count(1)
        self.device_tokens = 0  # tokens of device nodes (full pool)
        self.swa_tokens = 0  # tokens of device nodes whose SWA side is alive
        self.locked_tokens = 0
        self.locked_swa_tokens = 0
        self.host_tokens = 0
        # nodes that left the device (to the host tier or dropped), had their SWA side freed, came back
        self.evictions = self.tombstones = self.loadbacks = 0
        self.path_counts = dict.fromkeys(PREFIX_CACHE_PATHS, 0)  # runtime/mem_cache/paths.py

    # ---- sizes -------------------------------------------------------------------------------------------
    def evictable(self) -> tuple[int, int]:
        """(full, SWA) tokens that eviction could free now: those of unlocked device nodes."""
        return self.device_tokens - self.locked_tokens, self.swa_tokens - self.locked_swa_tokens

    # ---- match -------------------------------------------------------------------------------------------
    def match(self, ids: list[int], limit: int) -> PrefixMatch:
        """The longest usable cached prefix of `ids`, at most `limit` tokens, locked for the caller.

        Usable: every node on it on (or brought back to) the device, and the SWA side of its last W-1 tokens
        alive. Host nodes on the way are loaded back if the pools can make room; otherwise the prefix stops
        before them."""
        limit = min(limit, len(ids)) // self.page_size * self.page_size
        path = self._walk(ids, limit)
        while True:
            end = self._best_end(path)
            if end == 0:
                return self.empty
            path = self._cut(path, end)
            restored = self._restore(path)
            if restored == len(path):
                break
            path = path[:restored]  # the pools could not take the rest back: try the shorter prefix
        node = path[-1][0]
        self.path_counts["prefix_hit"] += 1
        self._lock(node)
        tick = next(self._clock)
        for n, _, _ in path:
            n.last_access = tick
        locs = tuple(loc for n, _, _ in path for loc in n.locs)
        return PrefixMatch(node, end, locs)

    def release(self, match: PrefixMatch) -> None:
        if match.node is not self.root:
            self._unlock(match.node)

    def _walk(self, ids: list[int], limit: int) -> list[tuple[Node, int, int]]:
        """Nodes along `ids[:limit]` as (node, start, end) positions; the last may be matched in part."""
        ps, node, i, path = self.page_size, self.root, 0, []
        while i < limit:
            child = node.children.get(tuple(ids[i:i + ps]))
            if child is None:
                break
            n = _common(child.key, ids, i, limit) // ps * ps
            if n == 0:
                break
            path.append((child, i, i + n))
            i += n
            if n < len(child.key):
                break
            node = child
        return path

    def _covers(self, alive_from: int, end: int) -> bool:
        """Whether SWA alive from position `alive_from` up to `end` covers the window of a query at `end`."""
        if alive_from == 0:
            return True
        return self.window is not None and alive_from <= end - self.window + 1

    def _best_end(self, path: list[tuple[Node, int, int]]) -> int:
        best, run = 0, None  # run: start of the alive SWA run the walk is in
        for node, start, end in path:
            if not node.swa:
                run = None
                continue
            if run is None:
                run = start
            if self._covers(run, end):
                best = end
        return best

    def _cut(self, path, end: int):
        """`path` up to position `end`, splitting the node that `end` falls inside."""
        out = []
        for node, start, stop in path:
            if start >= end:
                break
            if stop > end or (stop == end and end - start < len(node.key)):
                node = self._split(node, end - start)
                stop = end
            out.append((node, start, stop))
        return out

    def _restore(self, path) -> int:
        """Load the host nodes of `path` back; the number of leading path entries now on the device."""
        host = [node for node, _, _ in path if not node.on_device]
        if not host:
            return len(path)
        deepest = path[-1][0]
        self._lock(deepest)  # nothing on the path may be evicted (or dropped from the host) meanwhile
        try:
            restored, starts = 0, {id(node): start for node, start, _ in path}
            for node in host:
                n = len(node.key)
                self.make_room(n, n if node.swa else 0)
                locs = self.store.node_from_host(node.host)
                if locs is None:
                    break
                self._account(node, -1)
                node.locs, node.host = locs, None
                self._account(node, +1)
                self.store.to_tree(locs, starts[id(node)])
                restored += 1
            if restored:
                self.path_counts["restore_from_host"] += 1
                self.store.register_loadback()
                self.loadbacks += restored
        finally:
            self._unlock(deepest)
        return next((i for i, (node, _, _) in enumerate(path) if not node.on_device), len(path))

    # ---- insert ------------------------------------------------------------------------------------------
    def insert(self, ids: list[int], locs: list[int], held: PrefixMatch, swa_from: int) -> None:
        """Take ownership of a finished request's KV and release its hold. `locs` are the full slots of
        positions 0..len-1 of `ids` (KV written for all); the first `held.length` are the tree's own. Of the
        request's slots, those at positions >= `swa_from` have their SWA side mapped.

        The tree keeps SWA only for the last window of the inserted key (from `keep_from(end)`: the key less its
        last page, what a request resending the same prompt reuses, is usable too) and frees the rest: slots of
        tokens it already holds (unless its own copy lost its SWA side inside that window and no request holds
        it: then the request's copy replaces it), a trailing partial page, SWA before the last window."""
        ps = self.page_size
        end = len(locs) // ps * ps
        alive = max(swa_from, self.keep_from(end))  # the request's SWA is kept from here on
        free, tombstone = list(locs[end:]), []
        node, i = held.node, held.length
        while i < end:
            child = node.children.get(tuple(ids[i:i + ps]))
            if child is None:
                break
            n = _common(child.key, ids, i, end) // ps * ps
            replaceable = not child.on_device or (not child.swa and not child.lock)
            if replaceable and i < alive < i + n:
                n = alive - i  # the parts before and after `alive` are taken differently
            if n < len(child.key):
                child = self._split(child, n)
            part = locs[i:i + n]
            if not child.on_device:  # the tree's copy is on the host: take the device one
                self.path_counts["insert_replace_host"] += 1
                tombstone += part[max(swa_from - i, 0):] if i < alive else []
                self._take(child, part, i, swa=i >= alive)
            elif replaceable and i >= alive:  # the tree's copy lost its SWA side where the window needs it
                self.path_counts["insert_replace_tombstoned"] += 1
                free += child.locs
                self._take(child, part, i, swa=True)
            else:
                self.path_counts["insert_shared"] += 1
                free += part  # the tree holds these tokens already
            node, i = child, i + n
        if i < end:
            if self._covers(self._alive_run(node, i, alive), end):
                tombstone += locs[max(i, swa_from):max(i, alive)]
                if alive > i:
                    node = self._new_child(node, ids[i:alive], locs[i:alive], i, swa=False)
                node = self._new_child(node, ids[max(i, alive):end], locs[max(i, alive):end], max(i, alive), swa=True)
                self.path_counts["insert_new_node"] += 1
            else:
                free += locs[i:end]  # no usable prefix would end in it: not worth holding
        if tombstone:
            self.stats.evicted_tokens["swa"] += self.store.free_swa(tombstone, "prefix_tombstone")
            self.tombstones += 1
        if free:
            self.store.free(free)
        tick = next(self._clock)
        n = node
        while n is not self.root:
            n.last_access = tick
            n = n.parent
        self.release(held)

    def keep_from(self, end: int) -> int:
        """First position whose SWA the tree keeps for a key of `end` tokens: what a query at `end` or at
        `end` less one page reads (a prompt must leave at least one token to compute). Page-aligned."""
        if self.window is None:
            return 0
        return max(0, end - self.page_size - self.window + 1) // self.page_size * self.page_size

    def _alive_run(self, parent: Node, start: int, alive: int) -> int:
        """Where the alive SWA run ending in new tokens start.. (alive from `alive`) begins."""
        if alive > start:
            return alive
        run, n = start, parent
        while n is not self.root and n.swa:
            run -= len(n.key)
            n = n.parent
        return run

    def _take(self, node: Node, locs: list[int], start: int, swa: bool) -> None:
        """The node's tokens (positions start..) are now the request's slots `locs` (its old copy was freed or is
        dropped here)."""
        self._account(node, -1)
        if not node.on_device:
            self.store.drop(node.host)
            node.host = None
        node.locs, node.swa = list(locs), swa
        self._account(node, +1)
        self.store.to_tree(node.locs, start)

    def _new_child(self, parent: Node, key: list[int], locs: list[int], start: int, swa: bool) -> Node:
        """A node for positions start.. of a finished request, holding its slots `locs`."""
        node = Node(list(key), list(locs), swa, parent)
        parent.children[tuple(key[:self.page_size])] = node
        self._account(node, +1)
        self.store.to_tree(node.locs, start)
        return node

    def _split(self, node: Node, k: int) -> Node:
        """Split `node` after its first k tokens; returns the new upper node (same state, lock, age)."""
        self._account(node, -1)
        self.path_counts["prefix_split" if node.on_device else "prefix_split_host"] += 1
        upper_host = None
        if not node.on_device:
            upper_host, node.host = node.host.split(k)
        upper = Node(node.key[:k], node.locs[:k] if node.on_device else None, node.swa, node.parent, upper_host)
        upper.lock, upper.last_access = node.lock, node.last_access
        node.parent.children[tuple(node.key[:self.page_size])] = upper
        node.key = node.key[k:]
        if node.locs is not None:
            node.locs = node.locs[k:]
        node.parent = upper
        upper.children[tuple(node.key[:self.page_size])] = node
        self._account(node, +1)
        self._account(upper, +1)
        return upper

    # ---- eviction ----------------------------------------------------------------------------------------
    def make_room(self, full: int, swa: int) -> None:
        """Evict until `full` full-pool and `swa` SWA-pool tokens are free, or nothing unlocked is left."""
        free_full, free_swa = self.store.free_tokens()
        if free_full < full:
            self._evict_leaves(full - free_full)
            free_full, free_swa = self.store.free_tokens()
        if free_swa < swa:
            self._evict_swa(swa - free_swa)

    def _evict_leaves(self, tokens: int) -> None:
        """Evict unlocked device leaves, least recently used first, until `tokens` full slots were freed."""
        order = itertools.count()
        heap = [(n.last_access, next(order), n) for n in self.nodes() if self._evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < tokens:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            freed += len(node.key)
            self._evict(node)
            if self._evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, next(order), parent))

    def _evict_swa(self, tokens: int) -> None:
        """Free the SWA side of unlocked device nodes, least recently used first (a leaf goes entirely)."""
        freed = 0
        self.path_counts["swa_pressure_locked"] += any(n.lock and n.on_device and n.swa for n in self.nodes())
        for node in sorted((n for n in self.nodes() if n.on_device and n.swa and not n.lock),
                           key=lambda n: n.last_access):
            if freed >= tokens:
                break
            if not (node.on_device and node.swa):  # changed by an earlier eviction in this loop
                continue
            freed += len(node.key)
            evict = self._evictable_leaf(node)
            self.path_counts["swa_pressure_evict" if evict else "swa_pressure_tombstone"] += 1
            if evict:
                self._evict(node)
            else:
                self._tombstone(node)

    def _tombstone(self, node: Node) -> None:
        self._account(node, -1)
        self.stats.evicted_tokens["swa"] += self.store.free_swa(node.locs, "prefix_tombstone")
        self.tombstones += 1
        node.swa = False
        self._account(node, +1)

    def _evictable_leaf(self, node: Node) -> bool:
        return (node is not self.root and node.on_device and not node.lock
                and not any(c.on_device for c in node.children.values()))

    def _evict(self, node: Node) -> None:
        """An unlocked device leaf leaves the device: to the host tier if it can serve a later match there
        (its window, or the host nodes below it) and the tier has room, else dropped with its subtree."""
        n = len(node.key)
        host = None
        if (node.swa or node.children) and self._host_room(n, node):
            host = self.store.node_to_host(node.locs, node.swa)
        self.evictions += 1
        self.stats.evicted_tokens["full"] += n
        if node.swa:
            self.stats.evicted_tokens["swa"] += n
        self._account(node, -1)
        self.path_counts["evict_drop" if host is None else "evict_to_host"] += 1
        self.store.free(node.locs, "prefix_evict")
        if host is not None:
            node.locs, node.host = None, host
            self._account(node, +1)
        else:
            node.locs = None
            self._remove(node)

    def _host_room(self, tokens: int, keep: Node) -> bool:
        """Make room on the host tier by dropping its least recently used leaves (not below `keep`)."""
        if self.store.host_can_hold(tokens):
            return True
        leaves = sorted((n for n in self.nodes() if not n.on_device and not n.children and not n.lock
                         and not _below(n, keep)), key=lambda n: n.last_access)
        for leaf in leaves:
            self.path_counts["host_drop"] += 1
            self._remove(leaf)
            if self.store.host_can_hold(tokens):
                return True
        return False

    def _remove(self, node: Node) -> None:
        """Unlink `node` (its device slots already freed) and drop the host copies below it."""
        del node.parent.children[tuple(node.key[:self.page_size])]
        stack = list(node.children.values())
        if not node.on_device:
            self._account(node, -1)
            self.store.drop(node.host)
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            self._account(n, -1)
            self.store.drop(n.host)

    def clear(self) -> None:
        """Drop every node (none may be locked): the pools and the host tier then hold nothing for the tree."""
        nodes = list(self.nodes())
        if any(n.lock for n in nodes):
            raise RuntimeError("prefix cache cleared while a request holds a prefix")
        for node in nodes:
            self._account(node, -1)
            if node.on_device:
                self.store.free(node.locs, "prefix_evict")
            else:
                self.store.drop(node.host)
        self.root.children = {}

    # ---- locks and accounting ----------------------------------------------------------------------------
    def _lock(self, node: Node, delta: int = 1) -> None:
        """Add `delta` to the lock count of `node` and every ancestor (a lock protects the whole prefix)."""
        while node is not self.root:
            self._account(node, -1)
            node.lock += delta
            self._account(node, +1)
            node = node.parent

    def _unlock(self, node: Node) -> None:
        self._lock(node, -1)

    def _account(self, node: Node, sign: int) -> None:
        """Add (+1) or remove (-1) a node's share of the sizes and gauges; called around every change."""
        n = sign * len(node.key)
        s = self.stats
        if node.on_device:
            self.device_tokens += n
            s.cached_tokens["full"] += n
            if node.lock:
                self.locked_tokens += n
            if node.swa:
                self.swa_tokens += n
                s.cached_tokens["swa"] += n
                if node.lock:
                    self.locked_swa_tokens += n
            s.nodes["device" if node.swa else "tombstoned"] += sign
        else:
            self.host_tokens += n
            s.nodes["host"] += sign

    def nodes(self) -> Iterator[Node]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _common(key: list[int], ids: list[int], start: int, limit: int) -> int:
    """Length of the common prefix of `key` and ids[start:limit]."""
    n = min(len(key), limit - start)
    for j in range(n):
        if key[j] != ids[start + j]:
            return j
    return n


def _below(node: Node, ancestor: Node) -> bool:
    while node is not None:
        if node is ancestor:
            return True
        node = node.parent
    return False
