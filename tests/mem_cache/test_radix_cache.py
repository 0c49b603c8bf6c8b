"""The prefix cache's rules one at a time, on real pools (no model): what a match returns, what an insert keeps,
which node eviction picks, where an evicted node goes and how it comes back."""

import pytest
import torch

from runtime.mem_cache.hicache import HostKVCache
from runtime.mem_cache.slots import KVSlots
from runtime.mem_cache.swa_pool import build_hybrid_kv_pool
from telemetry.stats import EngineStats

W = 4  # sliding window


def make(full=32, swa=16, page_size=1, host=0):
    stats = EngineStats("memo")
    pool = build_hybrid_kv_pool(full_size=full, swa_size=swa, page_size=page_size, layer_is_swa=[True, False],
                                num_kv_heads=1, head_dim=1, dtype=torch.float32, policy="memo",
                                stats=stats.translation, reporter=None)
    slots = KVSlots(pool.allocator, HostKVCache(pool, host, stats), prefix_cache=True, window=W,
                    stats=stats.prefix_cache)
    return slots, stats


def run(slots, ids, match=None):
    """A request over `ids` that reuses `match` (or nothing), computes the rest and releases its window like
    the scheduler; returns (locs, swa_released_upto)."""
    q = match.length if match else 0
    locs = list(match.locs) if match else []
    locs += slots.alloc_extend([q], [len(ids)], [locs[-1] if locs else -1])
    ps = slots.page_size
    cut = slots.tree.keep_from(len(locs) // ps * ps)
    released = q
    if cut > q:
        slots.free_swa(locs[q:cut])
        released = cut // ps * ps
    return locs, released


def finish(slots, ids, match=None):
    locs, released = run(slots, ids, match)
    slots.cache_prefix(ids, locs, match, released)
    return locs


def mapped(slots, locs):
    return [int(x) > 0 for x in slots.allocator.full_to_swa_index_mapping[torch.tensor(locs)]]


def test_an_insert_keeps_full_kv_and_only_the_last_windows_swa_and_a_match_reuses_it():
    slots, stats = make()
    ids = list(range(10, 20))
    locs = finish(slots, ids)
    tree = slots.tree
    # SWA for the window a query at 10 or at 9 reads: positions 6..9 (the same prompt resent can reuse 9)
    assert tree.device_tokens == 10 and tree.swa_tokens == W
    assert mapped(slots, locs) == [False] * 6 + [True] * 4
    assert stats.prefix_cache.nodes == {"device": 1, "tombstoned": 1, "host": 0}
    m = slots.match_prefix(ids + [99], 10)
    assert m.length == 10 and list(m.locs) == locs
    usage = slots.usage()  # the held prefix is in use, not evictable
    assert tree.locked_tokens == 10 and (usage["full", "used"], usage["swa", "used"]) == (10, W)
    slots.release_prefix(m)
    usage = slots.usage()  # unlocked: it counts as available (eviction frees it on demand)
    assert tree.locked_tokens == 0 and (usage["full", "available"], usage["swa", "available"]) == (32, 16)


def test_a_prefix_whose_window_is_tombstoned_is_not_returned_and_a_shorter_usable_one_is():
    slots, _ = make()
    first = list(range(10, 20))
    finish(slots, first)  # SWA kept for positions 6..9 only
    # a prompt that diverges at position 8: the prefix of 8 tokens lacks SWA at position 5
    assert slots.match_prefix(first[:8] + [1, 2], 9).length == 0
    # the whole key is usable, and so is all but its last token (the same prompt resent: one left to compute)
    assert slots.match_prefix(first + [1], 10).length == 10
    assert slots.match_prefix(first, 9).length == 9


def test_a_short_prefix_needs_swa_from_position_zero():
    slots, _ = make()
    finish(slots, [5, 6, 7])  # shorter than a window: every position keeps its SWA slot
    m = slots.match_prefix([5, 6, 7, 8], 3)
    assert m.length == 3 and all(mapped(slots, list(m.locs)))


def test_eviction_is_least_recently_used_first_and_frees_through_the_hooked_mutations():
    slots, stats = make(full=32, swa=32)
    a, b = list(range(10, 22)), list(range(30, 42))
    finish(slots, a)
    finish(slots, b)
    slots.release_prefix(slots.match_prefix(a + [1], 12))  # a is now the most recently used
    slots.tree.make_room(20, 0)  # 8 free: one 12-token leaf must go
    assert slots.match_prefix(b + [1], 12).length == 0
    m = slots.match_prefix(a + [1], 12)
    assert m.length == 12
    slots.release_prefix(m)
    inv = stats.translation.invalidation_counts
    assert inv["prefix_evict"] >= 1 and stats.prefix_cache.evicted_tokens["full"] == 12


def test_swa_pressure_tombstones_an_inner_window_and_evicts_a_leaf_entirely():
    slots, stats = make(full=64, swa=16)
    turn1 = list(range(10, 20))
    finish(slots, turn1)
    m1 = slots.match_prefix(turn1 + [50, 51, 52, 53, 54, 55], 10)
    finish(slots, turn1 + [50, 51, 52, 53, 54, 55], m1)  # turn 2: turn 1's window is now an inner node's
    tree = slots.tree
    assert tree.swa_tokens == 2 * W
    slots.tree.make_room(0, 16 - 4)  # 8 of 16 SWA slots free: 4 more wanted
    # the older window (turn 1's end, an inner node) went first: tombstoned, its full KV kept
    assert tree.tombstones >= 1 and stats.translation.invalidation_counts["prefix_tombstone"] >= 1
    assert slots.match_prefix(turn1 + [1], 10).length == 0
    m = slots.match_prefix(turn1 + [50, 51, 52, 53, 54, 55, 9], 16)
    assert m.length == 16
    slots.release_prefix(m)
    full = tree.device_tokens
    slots.tree.make_room(0, 16)  # a leaf's SWA side is its only use: the leaf goes entirely
    assert tree.swa_tokens == 0 and tree.device_tokens == full - W
    assert slots.allocator.swa.used_size() == 0


@pytest.mark.parametrize("page_size", [1, 2])
def test_evicted_nodes_go_to_the_host_tier_and_come_back_with_one_registered_mapping(page_size):
    slots, stats = make(full=32, swa=16, page_size=page_size, host=64)
    a = list(range(10, 22))
    locs = finish(slots, a)
    pool = slots.host.pool
    before = pool.full_pool.k_buffers[0][torch.tensor(locs)].clone()  # whatever KV the slots hold
    slots.tree.make_room(32, 16)  # everything off the device
    tree = slots.tree
    assert tree.device_tokens == 0 and tree.host_tokens == 12
    assert slots.host.used == 12 and slots.host.used_bytes == stats.hicache_bytes["offload"]
    generation = slots.allocator.mapping_generation
    m = slots.match_prefix(a + [1], 12)
    assert m.length == 12 and tree.loadbacks >= 1 and tree.host_tokens == 0
    assert slots.allocator.mapping_generation == generation + 1
    assert stats.translation.invalidation_counts["prefix_loadback"] == 1
    assert torch.equal(pool.full_pool.k_buffers[0][torch.tensor(list(m.locs))], before)
    assert mapped(slots, list(m.locs))[-(W - 1):] == [True] * (W - 1)
    assert slots.host.used == 0 and slots.host.used_bytes == 0
    slots.release_prefix(m)


def test_without_a_host_tier_evicted_nodes_are_dropped():
    slots, _ = make(host=0)
    finish(slots, list(range(10, 22)))
    slots.tree.make_room(32, 16)
    assert list(slots.tree.nodes()) == [] and slots.allocator.full.used_size() == 0


def test_a_locked_prefix_is_never_evicted():
    slots, _ = make(full=16, swa=16)
    a = list(range(10, 22))
    finish(slots, a)
    m = slots.match_prefix(a + [1], 12)
    slots.tree.make_room(16, 16)
    assert slots.tree.device_tokens == 12 and slots.allocator.full.available_size() == 4
    slots.release_prefix(m)
    slots.tree.make_room(16, 16)
    assert slots.tree.device_tokens == 0


def test_two_requests_share_a_prefix_and_window_eviction_never_frees_the_trees_slots():
    slots, _ = make(full=64, swa=32)
    shared = list(range(10, 22))
    finish(slots, shared)
    m1 = slots.match_prefix(shared + [1, 2, 3, 4, 5, 6], 17)
    m2 = slots.match_prefix(shared + [7, 8, 9, 10, 11, 12], 17)
    assert m1.locs == m2.locs and slots.tree.root.children  # the same slots, held twice
    node = m1.node
    assert node.lock == 2
    r1, rel1 = run(slots, shared + [1, 2, 3, 4, 5, 6], m1)
    r2, rel2 = run(slots, shared + [7, 8, 9, 10, 11, 12], m2)
    # both windows have moved past the shared prefix; its SWA side (the tree's) is still mapped
    assert rel1 == rel2 == 18 - 1 - W + 1 and all(mapped(slots, list(m1.locs))[-W:])
    slots.cache_prefix(shared + [1, 2, 3, 4, 5, 6], r1, m1, rel1)
    slots.cache_prefix(shared + [7, 8, 9, 10, 11, 12], r2, m2, rel2)
    assert node.lock == 0 and slots.tree.device_tokens == 12 + 6 + 6


def test_an_insert_replaces_a_tombstoned_window_with_the_requests_own():
    slots, _ = make(full=64, swa=16)
    a = list(range(10, 20))
    finish(slots, a)
    finish(slots, a + [3, 4, 5, 6, 7], slots.match_prefix(a + [3, 4, 5, 6, 7], 10))
    slots.tree.make_room(0, 16 - 4)  # SWA pressure: a's window (now an inner node) is tombstoned
    assert slots.tree.tombstones == 1
    assert slots.match_prefix(a + [9, 1], 11).length == 0  # nothing usable: the request computes it all
    locs = finish(slots, a + [9])
    m = slots.match_prefix(a + [9, 1], 11)
    assert m.length == 11 and list(m.locs)[8:] == locs[8:]  # positions 8, 9 now hold the request's copy
    assert all(mapped(slots, list(m.locs))[-(W - 1):])
    slots.release_prefix(m)
