"""The prefix cache under random operation sequences, against a pure-Python reference.

Requests over a small token alphabet (so that prefixes are shared often) start by matching the cache, get
slots for the rest, write their KV, slide their window, grow, finish into the cache, abort, or are retracted to
the host tier and loaded back; the cache evicts under pressure in both pools, to a host tier or not. The KV
"computed" for a token is a function of the tokens up to it (what a model would compute), so the reference
is a recompute. After every step:

- every device node's full KV, its SWA KV where its SWA side is alive, and every host copy equal the
  recompute; every prefix a match returns does too, and its last window has SWA slots;
- no slot leaks: the pools hold exactly the cache's nodes plus the running requests' own tokens, and the
  mapped SWA slots are exactly the SWA slots in use;
- the host tier's tokens and bytes are those of the cache's host nodes and the retracted requests' copies;
- lock counts, sizes and gauges equal a recount of the tree;
- right after an insert (none of its prefix held by another request) with no eviction since, a match finds
  the whole inserted prefix.
"""

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from runtime.mem_cache.hicache import HostKV, HostKVCache
from runtime.mem_cache.radix_cache import PrefixMatch
from runtime.mem_cache.slots import KVSlots
from runtime.mem_cache.swa_pool import build_hybrid_kv_pool
from telemetry.stats import EngineStats

FULL, SWA, WINDOW = 48, 24, 4


def kv_of(ids: tuple[int, ...]) -> float:
    """The KV a model would compute for the last token of `ids` (a function of the whole prefix)."""
    return float(hash(ids) % 1_000_003)


@dataclass(eq=False)
class Running:
    ids: list[int]
    locs: list[int]
    hold: PrefixMatch | None
    released: int  # own positions below this have no SWA slot (the scheduler's swa_released_upto)


class RadixMachine(RuleBasedStateMachine):
    page_size = 1
    host_tokens = 0

    def __init__(self):
        super().__init__()
        self.stats = EngineStats("off")
        self.pool = build_hybrid_kv_pool(
            full_size=FULL, swa_size=SWA, page_size=self.page_size, layer_is_swa=[True, False], num_kv_heads=1,
            head_dim=1, dtype=torch.float64, policy="off", stats=self.stats.translation, reporter=None,
        )
        self.alloc = self.pool.allocator
        self.slots = KVSlots(self.alloc, HostKVCache(self.pool, self.host_tokens, self.stats), prefix_cache=True,
                             window=WINDOW, stats=self.stats.prefix_cache)
        self.tree = self.slots.tree
        self.running: list[Running] = []
        self.parked: list[tuple[list[int], HostKV]] = []  # retracted to the host tier
        self.finished: list[list[int]] = []  # sequences inserted so far, to build shared prefixes from
        self.just_inserted: list[int] | None = None  # inserted, and nothing evicted since

    # ---- helpers -------------------------------------------------------------------------------------------
    def _mapping(self, locs: list[int]) -> list[int]:
        return self.alloc.full_to_swa_index_mapping[torch.tensor(locs, dtype=torch.int64)].tolist() if locs else []

    def _write_kv(self, ids: list[int], locs: list[int], start: int) -> None:
        """The "forward": KV of positions start.. into the full pool and, through the mapping, the SWA pool."""
        new = locs[start:]
        values = torch.tensor([kv_of(tuple(ids[:p + 1])) for p in range(start, len(locs))], dtype=torch.float64)
        full = torch.tensor(new, dtype=torch.int64)
        swa = self.alloc.full_to_swa_index_mapping[full]
        assert bool((swa > 0).all()), "a newly allocated token has no SWA slot"
        for pool, where in ((self.pool.full_pool, full), (self.pool.swa_pool, swa)):
            pool.k_buffers[0][where] = values.view(-1, 1, 1)
            pool.v_buffers[0][where] = -values.view(-1, 1, 1)

    def _check_kv(self, ids, locs, swa_from: int) -> None:
        """Full KV of every position, SWA KV of positions >= swa_from, equal the recompute."""
        if not locs:
            return
        expect = torch.tensor([kv_of(tuple(ids[:p + 1])) for p in range(len(locs))], dtype=torch.float64)
        full = torch.tensor(locs, dtype=torch.int64)
        assert torch.equal(self.pool.full_pool.k_buffers[0][full].flatten(), expect)
        assert torch.equal(self.pool.full_pool.v_buffers[0][full].flatten(), -expect)
        swa = self.alloc.full_to_swa_index_mapping[full[swa_from:]]
        assert bool((swa > 0).all()), "a token inside the window has no SWA slot"
        assert torch.equal(self.pool.swa_pool.k_buffers[0][swa].flatten(), expect[swa_from:])

    def _window_start(self, n: int) -> int:
        return max(0, n - WINDOW + 1)

    def _release_window(self, r: Running) -> None:
        """What the scheduler does after a forward with the cache on: free what the cache will not keep."""
        cut = self.tree.keep_from(len(r.locs) // self.page_size * self.page_size)
        if cut > r.released:
            self.slots.free_swa(r.locs[r.released:cut])
            r.released = cut // self.page_size * self.page_size

    def _own_from(self, r: Running) -> int:
        return r.hold.length if r.hold is not None else 0

    def _evictions(self) -> tuple[int, int]:
        return self.tree.evictions, self.tree.tombstones

    def _path_ids(self, node) -> list[int]:
        parts = []
        while node is not self.tree.root:
            parts.append(node.key)
            node = node.parent
        return [t for key in reversed(parts) for t in key]

    # ---- operations ----------------------------------------------------------------------------------------
    @precondition(lambda self: len(self.running) < 3)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=12))
    def start(self, data, extra):
        base = data.draw(st.sampled_from([[]] + self.finished)) if self.finished else []
        cut = data.draw(st.integers(0, len(base)))
        ids = base[:cut] + extra
        loadbacks, generation = self.tree.loadbacks, self.alloc.mapping_generation
        match = self.slots.match_prefix(ids, len(ids) - 1)
        q = match.length
        # nodes brought back from the host tier: one rebuilt mapping registered for all of them
        assert self.alloc.mapping_generation == generation + (self.tree.loadbacks > loadbacks)
        assert q <= len(ids) - 1 and q % self.page_size == 0
        self._check_kv(ids, list(match.locs), self._window_start(q))  # the last window has SWA slots
        if self.just_inserted is not None and self._evictions() == self.evictions_at_insert:
            ins = self.just_inserted
            common = next((i for i, (a, b) in enumerate(zip(ins, ids)) if a != b), min(len(ins), len(ids)))
            if common == len(ins) and len(ins) <= len(ids) - 1:
                assert q >= len(ins) // self.page_size * self.page_size, "an inserted prefix was not found"
        locs = self.slots.alloc_extend([q], [len(ids)], [match.locs[-1] if q else -1])
        if locs is None:
            self.slots.release_prefix(match)
            return
        r = Running(ids, list(match.locs) + locs, match if q else None, q)
        if not q:
            self.slots.release_prefix(match)
        self._write_kv(ids, r.locs, q)
        self._release_window(r)
        self.running.append(r)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def grow(self, data, extra):
        r = data.draw(st.sampled_from(self.running))
        n = len(r.locs)
        locs = self.slots.alloc_extend([n], [n + len(extra)], [r.locs[-1]])
        if locs is None:
            return
        r.ids += extra
        r.locs += locs
        self._write_kv(r.ids, r.locs, n)
        self._release_window(r)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        r = data.draw(st.sampled_from(self.running))
        self.running.remove(r)
        self.slots.cache_prefix(r.ids, r.locs, r.hold, r.released)
        self.finished.append(list(r.ids))
        # With no other prefix held, every node of its last window could take the request's SWA slots
        self.just_inserted = None if any(o.hold for o in self.running) else list(r.ids)
        self.evictions_at_insert = self._evictions()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def abort(self, data):
        r = data.draw(st.sampled_from(self.running))
        self.running.remove(r)
        self.slots.free(r.locs[self._own_from(r):])
        if r.hold is not None:
            self.slots.release_prefix(r.hold)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def retract_to_host(self, data):
        """The scheduler's offload retraction: copy all of it (the window from its start), free what it owns."""
        r = data.draw(st.sampled_from(self.running))
        if not self.slots.can_offload(len(r.locs)):
            return
        swa_from = min(r.released, self._window_start(len(r.locs)) // self.page_size * self.page_size)
        kv = self.slots.offload(r.locs, swa_from)
        self.running.remove(r)
        self.slots.free(r.locs[self._own_from(r):])
        if r.hold is not None:
            self.slots.release_prefix(r.hold)
        self.parked.append((r.ids, kv))

    @precondition(lambda self: self.parked and len(self.running) < 3)
    @rule(data=st.data())
    def load_back(self, data):
        ids, kv = data.draw(st.sampled_from(self.parked))
        locs = self.slots.load_back(kv)
        if locs is None:
            return
        # by identity: list.remove compares with ==, and two parked entries with the same ids would compare
        # their KV tensors (an ambiguous truth value)
        self.parked = [p for p in self.parked if p[1] is not kv]
        self._check_kv(ids, locs, kv.swa_from)
        self.running.append(Running(ids, locs, None, kv.swa_from))

    @rule(full=st.integers(0, FULL), swa=st.integers(0, SWA))
    def evict(self, full, swa):
        self.tree.make_room(full, swa)

    # ---- invariants ----------------------------------------------------------------------------------------
    @invariant()
    def cached_kv_equals_a_recompute(self):
        for node in self.tree.nodes():
            ids = self._path_ids(node)
            start = len(ids) - len(node.key)
            expect = torch.tensor([kv_of(tuple(ids[:p + 1])) for p in range(start, len(ids))], dtype=torch.float64)
            if node.on_device:
                full = torch.tensor(node.locs, dtype=torch.int64)
                assert torch.equal(self.pool.full_pool.k_buffers[0][full].flatten(), expect)
                swa = self.alloc.full_to_swa_index_mapping[full]
                if node.swa:
                    assert bool((swa > 0).all())
                    assert torch.equal(self.pool.swa_pool.k_buffers[0][swa].flatten(), expect)
                else:
                    assert bool((swa == 0).all()), "a tombstoned node still maps SWA slots"
            else:
                assert torch.equal(node.host.full_k[0].flatten(), expect)
                assert node.host.swa_from == (0 if node.swa else len(node.key))
                if node.swa:
                    assert torch.equal(node.host.swa_k[0].flatten(), expect)
        for r in self.running:
            self._check_kv(r.ids, r.locs, self._window_start(len(r.locs)))

    @invariant()
    def no_slot_leaks_and_mapped_swa_slots_are_those_in_use(self):
        device = [n for n in self.tree.nodes() if n.on_device]
        own = [loc for r in self.running for loc in r.locs[self._own_from(r):]]
        full_slots = [loc for n in device for loc in n.locs] + own
        assert len(full_slots) == len(set(full_slots))
        ps = self.page_size
        used_pages = {loc // ps for loc in full_slots}
        assert self.alloc.full.used_size() == len(used_pages) * ps
        mapping = self.alloc.full_to_swa_index_mapping[:-1]
        mapped = {i: s for i, s in enumerate(mapping.tolist()) if s}
        expect_mapped = {loc for n in device if n.swa for loc in n.locs}
        expect_mapped |= {loc for r in self.running for loc in r.locs[max(self._own_from(r), r.released):]}
        assert set(mapped) == expect_mapped
        swa_slots = list(mapped.values())
        assert len(swa_slots) == len(set(swa_slots))
        held = {p for p in range(1, self.alloc.swa.num_pages + 1) if self.alloc.swa._held[p]}
        assert held == {s // ps for s in swa_slots}

    @invariant()
    def host_tier_tokens_and_bytes_are_accounted(self):
        host = [n.host for n in self.tree.nodes() if not n.on_device] + [kv for _, kv in self.parked]
        assert self.slots.host.used == sum(kv.num_tokens for kv in host) <= max(self.host_tokens, 0)
        assert self.slots.host.used_bytes == sum(kv.nbytes for kv in host)
        bytes_out, bytes_in = self.stats.hicache_bytes["offload"], self.stats.hicache_bytes["loadback"]
        assert bytes_out - bytes_in >= self.slots.host.used_bytes  # dropped copies went out and never came back

    @invariant()
    def locks_sizes_and_gauges_recount(self):
        holds = [r.hold.node for r in self.running if r.hold is not None]
        nodes = list(self.tree.nodes())
        for node in nodes:
            below = sum(1 for h in holds if _below(h, node))
            assert node.lock == below, node
            assert len(node.key) % self.page_size == 0 and node.key
            assert node.parent.children[tuple(node.key[:self.page_size])] is node
            if node.on_device:
                assert node.parent is self.tree.root or node.parent.on_device, "a device node below a host node"
        device = [n for n in nodes if n.on_device]
        t, g = self.tree, self.stats.prefix_cache
        assert t.device_tokens == g.cached_tokens["full"] == sum(len(n.key) for n in device)
        assert t.swa_tokens == g.cached_tokens["swa"] == sum(len(n.key) for n in device if n.swa)
        assert t.locked_tokens == sum(len(n.key) for n in device if n.lock)
        assert t.locked_swa_tokens == sum(len(n.key) for n in device if n.lock and n.swa)
        assert t.host_tokens == sum(len(n.key) for n in nodes if not n.on_device)
        assert g.nodes == {"device": sum(1 for n in device if n.swa), "tombstoned": sum(1 for n in device if not n.swa),
                           "host": len(nodes) - len(device)}
        usage = self.slots.usage()
        assert usage["full", "used"] + usage["full", "available"] == FULL

    def teardown(self):
        for r in list(self.running):
            self.slots.cache_prefix(r.ids, r.locs, r.hold, r.released)
        for _, kv in self.parked:
            self.slots.drop(kv)
        self.running, self.parked = [], []
        self.tree.clear()
        assert self.alloc.full.used_size() == 0 and self.alloc.swa.used_size() == 0
        assert int((self.alloc.full_to_swa_index_mapping[:-1] != 0).sum()) == 0
        assert self.slots.host.used == 0 and self.slots.host.used_bytes == 0


def _below(node, ancestor) -> bool:
    while node is not None:
        if node is ancestor:
            return True
        node = node.parent
    return False


SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.parametrize("host_tokens", [0, 64])
@pytest.mark.parametrize("page_size", [1, 2])
def test_random_operation_sequences_match_the_reference(page_size, host_tokens):
    machine = type(f"Radix_{page_size}_{host_tokens}", (RadixMachine,),
                   {"page_size": page_size, "host_tokens": host_tokens})
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()
