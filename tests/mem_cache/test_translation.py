"""The translation cache's contract (docs/translation-rules.md): each hazard is detected, classified and survived."""

from contextlib import contextmanager

import pytest
import torch

from runtime.faults import Faults
from runtime.mem_cache.mapping_record import STRIPE_ROWS

SLIDING = 3


@contextmanager
def fwd(pool, forward_id, mode="eager_extend"):
    """Tell the translator which forward runs, without the pool's forward-entry invalidation (the tests
    invalidate explicitly, or leave it out on purpose)."""
    pool.translator.begin_forward(forward_id, mode)
    try:
        yield
    finally:
        pool.translator.end_forward()


def events(pool):
    return {k: v for k, v in pool.stats.translation.key_change_counts.items() if v}


def fresh(pool, loc):
    return pool.allocator.full_to_swa_index_mapping[loc.long()].to(torch.int32)


def test_memo_gathers_once_per_forward_and_hits_on_the_other_sliding_layers(make_pool):
    pool = make_pool()
    loc = pool.allocator.alloc(4)
    t = pool.stats.translation
    for forward_id in (1, 2):
        with fwd(pool, forward_id):
            pool.invalidate_loc_cache("forward_entry")
            for layer in range(SLIDING):
                out = pool.translate_loc_from_full_to_swa(loc, "kv_write", layer)
                assert out.dtype == torch.int32 and torch.equal(out, fresh(pool, loc))
    assert t.translation_count == 2
    assert t.hit_counts["eager_extend"] == 2 * (SLIDING - 1)
    # the first forward's miss is cold (nothing was ever filled), the second's was emptied by invalidation
    assert t.miss_counts["eager_extend", "cold"] == 1
    assert t.miss_counts["eager_extend", "invalidated"] == 1
    assert events(pool) == {}


def test_equal_length_views_at_different_offsets_never_share_an_entry(make_pool):
    pool = make_pool()
    buf = pool.allocator.alloc(8)
    a, b = buf[:4], buf[4:]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.numel() == b.numel()
    with fwd(pool, 1):
        assert torch.equal(pool.translate_loc_from_full_to_swa(a, "kv_write"), fresh(pool, a))
        assert torch.equal(pool.translate_loc_from_full_to_swa(b, "kv_write"), fresh(pool, b))
    assert not torch.equal(fresh(pool, a), fresh(pool, b))
    assert events(pool) == {("kv_write", "benign_fresh_tensor"): 1}
    assert pool.stats.translation.miss_counts["eager_extend", "key_changed"] == 1


def test_a_storage_pointer_key_collides_on_views_and_is_classified_view_offset(make_pool):
    pool = make_pool(key_mode="storage")
    buf = pool.allocator.alloc(8)
    a, b = buf[:4], buf[4:]
    with fwd(pool, 1):
        pool.translate_loc_from_full_to_swa(a, "kv_write")
        out = pool.translate_loc_from_full_to_swa(b, "kv_write")
    assert torch.equal(out, fresh(pool, b))  # recomputed, not a's translation
    assert events(pool) == {("kv_write", "view_offset"): 1}


@pytest.mark.parametrize("mutation, site", [
    (lambda h, loc: h.alloc(2), "alloc"),
    (lambda h, loc: h.alloc_extend([0], [2], [-1]), "alloc"),
    (lambda h, loc: h.alloc_decode([1], [-1]), "alloc"),
    (lambda h, loc: h.free(loc[:1]), "free"),
    (lambda h, loc: h.free_swa(loc[:1]), "free_swa"),
    (lambda h, loc: h.clear(), "clear"),
    (lambda h, loc: h.set_full_to_swa_mapping(loc[:1], torch.tensor([16])), "set_mapping"),
    (lambda h, loc: h.clear_swa_mapping(loc[:1]), "clear_swa_mapping"),
    (lambda h, loc: h.register_mapping(h.full_to_swa_index_mapping.clone()), "register_mapping"),
])
@pytest.mark.parametrize("policy", ["memo", "layerwise"])
def test_every_mutation_point_invalidates(make_pool, policy, mutation, site):
    pool = make_pool(policy)
    loc = pool.allocator.alloc(4)
    t = pool.stats.translation
    with fwd(pool, 1):
        pool.translate_loc_from_full_to_swa(loc, "kv_write", 0)
        before = t.invalidation_counts[site]
        mutation(pool.allocator, loc)
        assert t.invalidation_counts[site] == before + 1
        out = pool.translate_loc_from_full_to_swa(loc, "kv_write", 1)
    assert torch.equal(out, fresh(pool, loc))
    assert t.miss_counts["eager_extend", "invalidated"] == 1
    assert events(pool) == {}


def test_in_place_rewrite_of_the_same_buffer_is_stale_loc_and_the_fresh_translation_wins(make_pool):
    pool = make_pool()
    locs = pool.allocator.alloc(8)
    static = locs[:4].clone()  # a persistent input buffer: same pointer, same length every step
    with fwd(pool, 1):
        old = pool.translate_loc_from_full_to_swa(static, "kv_write").clone()
        static.copy_(locs[4:])  # new contents, no invalidation
        out = pool.translate_loc_from_full_to_swa(static, "kv_write")
    assert torch.equal(out, fresh(pool, locs[4:])) and not torch.equal(out, old)
    assert events(pool) == {("kv_write", "stale_loc"): 1}
    assert pool.stats.translation.miss_counts["eager_extend", "stale_guard"] == 1
    (event,) = pool.reporter.first_events()
    assert event.cause == "loc buffer rewritten in place" and event.prev_forward_id == 1


def test_with_the_guard_off_the_stale_translation_is_returned_and_still_counted(make_pool):
    pool = make_pool(guard=False)
    locs = pool.allocator.alloc(8)
    static = locs[:4].clone()
    with fwd(pool, 1):
        old = pool.translate_loc_from_full_to_swa(static, "kv_write").clone()
        static.copy_(locs[4:])
        out = pool.translate_loc_from_full_to_swa(static, "kv_write")
    assert torch.equal(out, old) and not torch.equal(out, fresh(pool, static))  # the upstream pointer-key bug
    assert events(pool) == {("kv_write", "stale_loc"): 1}


def test_a_mapping_mutation_that_skips_invalidation_is_caught_by_the_guard(make_pool):
    pool = make_pool(faults=Faults.parse(["skip-alloc-invalidation"]))
    loc = pool.allocator.alloc(4)
    with fwd(pool, 1):
        pool.translate_loc_from_full_to_swa(loc, "kv_write")
        pool.allocator.set_full_to_swa_mapping(loc[:1], torch.tensor([16]))
        out = pool.translate_loc_from_full_to_swa(loc, "kv_write")
    assert int(out[0]) == 16
    (event,) = pool.reporter.first_events()
    assert event.classification == "stale_loc" and event.cause == "set_mapping wrote 1 row without invalidating"


def test_raw_writes_invisible_to_versions_are_caught_by_sampled_verification(make_pool):
    pool = make_pool(verify_rate=1.0)
    locs = pool.allocator.alloc(8)
    static = locs[:4].clone()
    with fwd(pool, 1):
        pool.translate_loc_from_full_to_swa(static, "kv_write")
        version = static._version
        static.numpy()[:] = locs[4:].numpy()  # a write through numpy: the version counter does not move
        assert static._version == version
        out = pool.translate_loc_from_full_to_swa(static, "kv_write")
    assert torch.equal(out, fresh(pool, locs[4:]))
    assert events(pool) == {("kv_write", "stale_loc"): 1}


def test_capture_after_warm_up_on_the_same_static_buffer_is_capture_pollution(make_pool):
    pool = make_pool()
    static = pool.allocator.alloc(4).clone()
    with fwd(pool, 1, "graph_capture"):  # warm-up run
        pool.translate_loc_from_full_to_swa(static, "kv_write")
    with fwd(pool, 2, "graph_capture"):  # capture run that forgot to invalidate first
        out = pool.translate_loc_from_full_to_swa(static, "kv_write")
    assert torch.equal(out, fresh(pool, static))
    assert events(pool) == {("kv_write", "capture_pollution"): 1}
    assert pool.stats.translation.miss_counts["graph_capture", "capture"] == 1
    assert pool.stats.translation.translation_count == 2  # the captured run did gather


def test_capture_that_invalidates_first_records_the_gather_without_any_event(make_pool):
    pool = make_pool()
    static = pool.allocator.alloc(4).clone()
    for forward_id in (1, 2):
        with fwd(pool, forward_id, "graph_capture"):
            pool.invalidate_loc_cache("graph_capture")
            pool.translate_loc_from_full_to_swa(static, "kv_write")
            pool.translate_loc_from_full_to_swa(static, "kv_write")  # same capture run: an ordinary hit
    assert events(pool) == {}
    assert pool.stats.translation.translation_count == 2
    assert pool.stats.translation.hit_counts["graph_capture"] == 2


def test_an_entry_from_an_earlier_forward_without_invalidation_is_cross_forward(make_pool):
    pool = make_pool()
    loc = pool.allocator.alloc(4)
    with fwd(pool, 1):
        pool.translate_loc_from_full_to_swa(loc, "kv_write")
    with fwd(pool, 2, "eager_decode"):  # the forward-entry invalidation is missing
        out = pool.translate_loc_from_full_to_swa(loc, "kv_write")
    assert torch.equal(out, fresh(pool, loc))
    assert events(pool) == {("kv_write", "cross_forward"): 1}
    (event,) = pool.reporter.first_events()
    assert (event.forward_id, event.prev_forward_id, event.prev_mode) == (2, 1, "eager_extend")


def test_the_window_buffers_one_off_translation_neither_evicts_nor_raises_events(make_pool):
    pool = make_pool()
    loc = pool.allocator.alloc(4)
    window = pool.allocator.alloc(6)
    t = pool.stats.translation
    with fwd(pool, 1):
        pool.invalidate_loc_cache("forward_entry")
        pool.translate_loc_from_full_to_swa(loc, "kv_write", 0)
        w = pool.translate_loc_from_full_to_swa(window, "window_indices")
        pool.translate_loc_from_full_to_swa(loc, "kv_write", 1)
    assert torch.equal(w, fresh(pool, window))
    assert t.hit_counts["eager_extend"] == 1 and events(pool) == {}


def test_routing_the_one_off_tensor_through_the_cache_evicts_the_forward_entry(make_pool):
    pool = make_pool(one_off_bypass=False)  # the window-buffer-pollution fault
    loc = pool.allocator.alloc(4)
    window = pool.allocator.alloc(6)
    with fwd(pool, 1):
        pool.translate_loc_from_full_to_swa(loc, "kv_write", 0)
        pool.translate_loc_from_full_to_swa(window, "window_indices")
        pool.translate_loc_from_full_to_swa(loc, "kv_write", 1)
    assert events(pool) == {("window_indices", "benign_fresh_tensor"): 1, ("kv_write", "benign_fresh_tensor"): 1}
    assert pool.stats.translation.translation_count == 3


@pytest.mark.parametrize("policy, gathers", [("memo", 1), ("layerwise", 1), ("per_forward", SLIDING), ("off", SLIDING)])
def test_policies_agree_on_values_and_differ_in_gathers(make_pool, policy, gathers):
    pool = make_pool(policy)
    loc = pool.allocator.alloc(4)
    with fwd(pool, 1):
        pool.invalidate_loc_cache("forward_entry")
        outs = [pool.translate_loc_from_full_to_swa(loc, "kv_write", layer) for layer in range(SLIDING)]
    assert all(torch.equal(o, fresh(pool, loc)) for o in outs)
    assert pool.stats.translation.translation_count == gathers


def test_layerwise_sees_a_different_tensor_at_a_later_layer_through_the_contents_guard(make_pool):
    """The layerwise key is the layer position, so another tensor would get the cached value; the guard's
    snapshot of the contents is what catches it (the guard off keeps the original fragility)."""
    for guard, expect_fresh in ((True, True), (False, False)):
        pool = make_pool("layerwise", guard=guard)
        a, b = pool.allocator.alloc(4), pool.allocator.alloc(4)
        with fwd(pool, 1):
            pool.translate_loc_from_full_to_swa(a, "kv_write", 0)
            out = pool.translate_loc_from_full_to_swa(b, "kv_write", 1)
        assert torch.equal(out, fresh(pool, b if expect_fresh else a))
        assert events(pool) == {("kv_write", "stale_loc"): 1}
        (event,) = pool.reporter.first_events()
        # nothing wrote `a`: another tensor took the key, and its version counter says nothing of `a`'s
        assert event.cause.startswith("another location tensor, with other contents, took the entry's key")


@pytest.mark.parametrize("skip_invalidation, expected_events", [
    (False, {}),
    (True, {("kv_write", "stale_loc"): 1}),  # the historical bug: caught by the mapping generation
])
def test_layerwise_register_mapping_clears_the_cached_location(make_pool, skip_invalidation, expected_events):
    pool = make_pool("layerwise", faults=Faults.parse(["skip-register-mapping-invalidation"] if skip_invalidation else []))
    loc = pool.allocator.alloc(4)
    with fwd(pool, 1):
        pool.translate_loc_from_full_to_swa(loc, "kv_write", 0)
        rebuilt = pool.allocator.full_to_swa_index_mapping.clone()
        rebuilt[loc[0]] = 16
        pool.register_mapping(rebuilt)
        out = pool.translate_loc_from_full_to_swa(loc, "kv_write", 1)
    assert int(out[0]) == 16
    assert events(pool) == expected_events


@pytest.mark.parametrize("bad, exc", [
    (torch.tensor([1.0]), TypeError),
    (torch.tensor([100]), IndexError),
    (torch.tensor([-2]), IndexError),
])
@pytest.mark.parametrize("policy", ["memo", "layerwise", "per_forward", "off"])
def test_bad_locations_raise_and_leave_the_cache_alone(make_pool, policy, bad, exc):
    pool = make_pool(policy)
    loc = pool.allocator.alloc(4)
    with fwd(pool, 1):
        pool.translate_loc_from_full_to_swa(loc, "kv_write", 0)
        with pytest.raises(exc):
            pool.translate_loc_from_full_to_swa(bad, "kv_write", 0)
    assert events(pool) == {}


def test_minus_one_translates_to_minus_one(make_pool):
    pool = make_pool()
    out = pool.translate_loc_from_full_to_swa(torch.tensor([-1, -1]), "kv_write")
    assert out.tolist() == [-1, -1]


def test_a_verification_repair_refills_the_entry_for_this_forward(make_pool):
    pool = make_pool(verify_rate=1.0)
    locs = pool.allocator.alloc(8)
    static = locs[:4].clone()
    mapping = pool.allocator.full_to_swa_index_mapping
    moved = mapping[locs[4:]].clone()
    with fwd(pool, 1):
        pool.translate_loc_from_full_to_swa(static, "kv_write", 0)
    mapping.numpy()[static.numpy()] = moved.numpy()  # outside the allocator, invisible to every version counter
    with fwd(pool, 2):  # and the forward-entry invalidation is missing
        outs = [pool.translate_loc_from_full_to_swa(static, "kv_write", layer) for layer in range(SLIDING)]
    assert all(torch.equal(o, moved.to(torch.int32)) for o in outs)
    # the first lookup crosses forwards and its verification repairs it; the repaired entry belongs to
    # forward 2, so the other layers are ordinary hits, not more cross-forward ones
    assert events(pool) == {("kv_write", "cross_forward"): 1, ("kv_write", "stale_loc"): 1}
    assert pool.stats.translation.hit_counts["eager_extend"] == SLIDING - 1
    stale = next(e for e in pool.reporter.first_events() if e.classification == "stale_loc")
    assert stale.cause.startswith("mapping changed outside every hooked mutation: a write no version counter sees")


def test_an_event_names_the_engine_code_that_asked_not_library_frames(make_pool):
    pool = make_pool()
    static = pool.allocator.alloc(4).clone()
    with fwd(pool, 1):
        pool.translate_loc_from_full_to_swa(static, "kv_write")
        static.add_(0)  # an in-place op: version bumps, contents equal
        pool.translate_loc_from_full_to_swa(static, "kv_write")
    (event,) = pool.reporter.first_events()
    assert "test_an_event_names_the_engine_code" in event.stack and "contextlib" not in event.stack


# ---- stale translations no version counter sees (issue 10): address reuse, unhooked mapping writes ----------
class CachingAllocator:
    """Hands out temporaries from one arena, the way a caching allocator (CUDA's, any pool) reuses a freed
    block at once: a new tensor object, its own version counter, the freed tensor's address. (glibc on a CPU
    reuses an address only now and then; the diagnose test `per_layer_temporary` meets that case for real.)"""

    def __init__(self, size: int = 64):
        self.arena = torch.zeros(size, dtype=torch.int64)

    def temporary(self, values: torch.Tensor) -> torch.Tensor:
        self.arena[: values.numel()] = values  # written through the arena: the temporary's counter stays put
        return torch.empty(0, dtype=torch.int64).set_(self.arena.untyped_storage(), 0, (values.numel(),))


@pytest.mark.parametrize("guard, verify, expect_fresh", [(True, 0.0, True), (True, 1.0, True), (False, 0.0, False)])
def test_a_freed_temporary_whose_address_is_reused_is_stale_loc_address_reuse(make_pool, guard, verify, expect_fresh):
    pool = make_pool(guard=guard, verify_rate=verify)
    locs = pool.allocator.alloc(8)
    cache = CachingAllocator()
    with fwd(pool, 1):
        tmp = cache.temporary(locs[:4])  # a per-layer temporary location tensor
        old = pool.translate_loc_from_full_to_swa(tmp, "kv_write").clone()
        ptr, version = tmp.data_ptr(), tmp._version
        del tmp  # freed ...
        tmp = cache.temporary(locs[4:])  # ... and a new one of the same length at its address
        assert (tmp.data_ptr(), tmp.numel(), tmp._version) == (ptr, 4, version)  # same key, same version
        out = pool.translate_loc_from_full_to_swa(tmp, "kv_write")
    assert torch.equal(out, fresh(pool, locs[4:]) if expect_fresh else old)
    assert not torch.equal(old, fresh(pool, locs[4:]))  # the stale value would be wrong
    assert events(pool) == {("kv_write", "stale_loc"): 1}
    (event,) = pool.reporter.first_events()
    assert event.cause.startswith("address reuse") and (event.prev_forward_id, event.forward_id) == (1, 1)
    assert "test_a_freed_temporary_whose_address" in event.stack


def test_a_live_temporary_at_the_same_address_with_the_same_contents_is_still_address_reuse(make_pool):
    """Identity, not contents: the tensor that filled the entry is gone, so the entry is not trusted even
    when the newcomer happens to hold the same locations (recomputed: the value is right either way)."""
    pool = make_pool()
    locs = pool.allocator.alloc(4)
    cache = CachingAllocator()
    with fwd(pool, 1):
        tmp = cache.temporary(locs)
        pool.translate_loc_from_full_to_swa(tmp, "kv_write")
        del tmp
        out = pool.translate_loc_from_full_to_swa(cache.temporary(locs), "kv_write")
    assert torch.equal(out, fresh(pool, locs))
    (event,) = pool.reporter.first_events()
    assert event.classification == "stale_loc" and event.cause.startswith("address reuse")


def test_another_view_of_the_same_live_buffer_is_the_same_memory_not_address_reuse(make_pool):
    """docs/translation-rules.md: a view of the same live buffer at the same address counts as the same tensor,
    even when each lookup slices a new view object (the one that filled the entry is gone by then)."""
    pool = make_pool()
    buf = pool.allocator.alloc(8).clone()
    with fwd(pool, 1):
        pool.invalidate_loc_cache("forward_entry")
        outs = [pool.translate_loc_from_full_to_swa(buf[2:6], "kv_write", layer) for layer in range(SLIDING)]
    assert all(torch.equal(o, fresh(pool, buf[2:6])) for o in outs)
    assert events(pool) == {} and pool.stats.translation.hit_counts["eager_extend"] == SLIDING - 1


def _torch_write(alloc, loc, swa):
    alloc.full_to_swa_index_mapping[loc] = swa  # a helper moving slots with plain indexing: no hook


def _numpy_write(alloc, loc, swa):
    alloc.full_to_swa_index_mapping.numpy()[loc.numpy()] = swa.numpy()  # no hook, no version bump


def _rebind(alloc, loc, swa):
    rebuilt = alloc.full_to_swa_index_mapping.clone()
    rebuilt[loc] = swa
    alloc.full_to_swa_index_mapping = rebuilt  # adopted without register_mapping


@pytest.mark.parametrize("verify", [0.0, 1.0])
@pytest.mark.parametrize("policy", ["memo", "layerwise"])
@pytest.mark.parametrize("write, kind, found_at_once", [
    (_torch_write, "written in place (its version counter moved)", True),
    (_rebind, "the mapping attribute was rebound to another tensor without register_mapping", True),
    (_numpy_write, "a write no version counter sees", False),  # found at the end of the forward
])
def test_a_mapping_write_outside_every_hooked_mutation_is_reported_with_forward_site_and_last_mutation(
        make_pool, policy, verify, write, kind, found_at_once):
    pool = make_pool(policy, verify_rate=verify)
    loc = pool.allocator.alloc(4)
    moved = pool.allocator.swa.alloc(4)  # free SWA slots to move the tokens to
    with fwd(pool, 7):
        pool.invalidate_loc_cache("forward_entry")
        pool.translate_loc_from_full_to_swa(loc, "kv_write", 0)
        write(pool.allocator, loc, moved)
        out = pool.translate_loc_from_full_to_swa(loc, "kv_write", 1)
        # default: fresh at once when torch or the attribute moved; a write no counter sees leaves this
        # forward's hits stale until its end. Strict: always fresh.
        stale_now = not found_at_once and verify == 0.0
        assert torch.equal(out, fresh(pool, loc)) != stale_now
        assert events(pool) == ({} if stale_now else {("kv_write", "stale_loc"): 1})
    assert events(pool) == {("kv_write", "stale_loc"): 1}  # reported once, in this forward
    (event,) = pool.reporter.first_events()
    assert event.cause.startswith(f"mapping changed outside every hooked mutation: {kind}"), event.cause
    assert "by forward 7 (eager_extend)" in event.cause and "last hooked mutation: alloc" in event.cause
    assert (event.site, event.forward_id) == ("kv_write", 7)
    with fwd(pool, 8):  # adopted after the report: nothing more
        pool.invalidate_loc_cache("forward_entry")
        pool.translate_loc_from_full_to_swa(loc, "kv_write", 0)
    assert events(pool) == {("kv_write", "stale_loc"): 1}


@pytest.mark.parametrize("policy, site", [("off", "kv_write"), ("per_forward", "attn_metadata")])
def test_uncached_policies_report_an_unhooked_mapping_write_at_their_own_translate_site(make_pool, policy, site):
    pool = make_pool(policy)
    loc = pool.allocator.alloc(4)
    with fwd(pool, 3):
        pool.translate_loc_from_full_to_swa(loc, site)
        _numpy_write(pool.allocator, loc, pool.allocator.swa.alloc(4))
    (event,) = pool.reporter.first_events()
    assert (event.classification, event.site, event.forward_id) == ("stale_loc", site, 3)
    assert event.cause.startswith("mapping changed outside every hooked mutation: a write no version counter sees")


# ---- the end-of-forward audit on a mapping larger than one stripe ------------------------------------------
STRIPES = 4  # a mapping of exactly four stripes


def _big_pool(make_pool, policy="memo"):
    return make_pool(policy, full_size=STRIPES * STRIPE_ROWS - 2, swa_size=64)  # + slot 0 and the sentinel


@pytest.mark.parametrize("policy", ["memo", "layerwise", "per_forward"])
def test_an_unseen_write_to_rows_a_forward_translates_is_found_in_that_forward(make_pool, policy):
    pool = _big_pool(make_pool, policy)
    loc = pool.allocator.alloc(4)
    site = "attn_metadata" if policy == "per_forward" else "kv_write"
    for forward_id in (1, 2):
        with fwd(pool, forward_id):
            pool.invalidate_loc_cache("forward_entry")
            pool.translate_loc_from_full_to_swa(loc, site, 0)
            if forward_id == 2:
                _numpy_write(pool.allocator, loc, pool.allocator.swa.alloc(4))
    (event,) = pool.reporter.first_events()
    assert event.forward_id == 2 and f"first at full slot {int(loc.min())}" in event.cause, event.cause
    assert "written after forward 1 ended, by forward 2" in event.cause, event.cause


def test_an_unseen_write_to_rows_nobody_translates_is_found_within_one_round_of_stripes(make_pool):
    pool = _big_pool(make_pool)
    mapping = pool.allocator.full_to_swa_index_mapping
    assert mapping.numel() == STRIPES * STRIPE_ROWS
    row = 3 * STRIPE_ROWS + 17  # in the last stripe, never translated
    loc = pool.allocator.alloc(4)
    found_at = None
    for forward_id in range(1, 2 * STRIPES + 1):
        with fwd(pool, forward_id):
            pool.invalidate_loc_cache("forward_entry")
            pool.translate_loc_from_full_to_swa(loc, "kv_write", 0)
            if forward_id == STRIPES + 1:  # the last stripe was checked clean at the end of forward STRIPES
                mapping.numpy()[row] = 5
        if found_at is None and pool.reporter.first_events():
            found_at = forward_id
    assert sum(events(pool).values()) == 1  # once, then adopted
    (event,) = pool.reporter.first_events()
    assert found_at == event.forward_id == 2 * STRIPES  # the next time its stripe came round
    assert f"1 row(s) differ from what the hooked mutations wrote, first at full slot {row}" in event.cause
    assert f"written after forward {STRIPES} ended, by forward {2 * STRIPES}" in event.cause, event.cause


def test_a_write_that_moves_the_version_counter_is_compared_whole_at_once(make_pool):
    pool = _big_pool(make_pool)
    loc = pool.allocator.alloc(4)
    with fwd(pool, 1):
        pool.invalidate_loc_cache("forward_entry")
        pool.translate_loc_from_full_to_swa(loc, "kv_write", 0)
        pool.allocator.full_to_swa_index_mapping[[5, 3 * STRIPE_ROWS + 1]] = 7  # torch: the counter moves
    (event,) = pool.reporter.first_events()
    assert event.forward_id == 1
    assert "written in place (its version counter moved); 2 row(s) differ" in event.cause, event.cause
    assert "first at full slot 5" in event.cause


# ---- no laundering by a load-back; the kind of write only when it is known (issue 21) ---------------------------
@pytest.mark.parametrize("write, kind", [
    (_torch_write, "written in place (its version counter moved)"),
    (_numpy_write, "a write no version counter sees"),
])
@pytest.mark.parametrize("site", ["register_mapping", "prefix_loadback"])
def test_a_load_back_audits_the_mapping_before_adopting_a_rebuilt_one(make_pool, write, kind, site):
    """Between forwards (after the last audit) an unhooked write, then a load-back registers a rebuilt mapping
    made from the current one: without the audit the write would be adopted and never counted."""
    pool = make_pool()
    loc = pool.allocator.alloc(4)
    moved = pool.allocator.swa.alloc(1)
    with fwd(pool, 3):
        pool.translate_loc_from_full_to_swa(loc, "kv_write")
    assert events(pool) == {}
    write(pool.allocator, loc[:1], moved)
    pool.register_mapping(pool.allocator.full_to_swa_index_mapping.clone(), site=site)
    assert events(pool) == {(site, "stale_loc"): 1}
    (event,) = pool.reporter.first_events()
    assert event.cause.startswith(f"mapping changed outside every hooked mutation: {kind}"), event.cause
    assert f"first at full slot {int(loc[0])}" in event.cause and "written after forward 3 ended" in event.cause
    assert f"found by the load-back at {site} after forward 3 (eager_extend)" in event.cause
    assert (event.forward_id, event.mode) == (3, "eager_extend")
    with fwd(pool, 4):  # adopted once reported: nothing more
        pool.translate_loc_from_full_to_swa(loc, "kv_write")
    assert events(pool) == {(site, "stale_loc"): 1}


def test_a_clean_load_back_counts_nothing(make_pool):
    pool = make_pool()
    loc = pool.allocator.alloc(4)
    with fwd(pool, 1):
        pool.translate_loc_from_full_to_swa(loc, "kv_write")
    pool.register_mapping(pool.allocator.full_to_swa_index_mapping.clone())
    assert events(pool) == {}


def test_a_torch_write_later_covered_by_a_hooked_write_is_still_said_to_move_the_counter(make_pool):
    """A hooked mutation after an unhooked torch write takes the version counter as its own; the record
    remembers that the counter had moved, so the write is not described as one no counter sees."""
    pool = make_pool()
    loc = pool.allocator.alloc(4)
    moved = pool.allocator.swa.alloc(1)
    _torch_write(pool.allocator, loc[:1], moved)
    pool.allocator.alloc(2)  # a hooked write: moves the counter again
    with fwd(pool, 2):
        pool.translate_loc_from_full_to_swa(loc, "kv_write")
    (event,) = pool.reporter.first_events()
    assert event.cause.startswith("mapping changed outside every hooked mutation: written in place (its version "
                                  "counter moved); 1 row(s) differ"), event.cause


def test_a_location_tensor_that_tracks_no_version_is_not_said_to_be_written_by_numpy(make_pool):
    with torch.inference_mode():
        made = torch.zeros(4, dtype=torch.int64)  # tracks no version
    pool = make_pool()
    locs = pool.allocator.alloc(8)
    with torch.inference_mode():
        made.copy_(locs[:4])
    with fwd(pool, 1):
        pool.translate_loc_from_full_to_swa(made, "kv_write")
        with torch.inference_mode():
            made.copy_(locs[4:])  # an ordinary torch write: no counter to see it
        pool.translate_loc_from_full_to_swa(made, "kv_write")
    (event,) = pool.reporter.first_events()
    assert event.cause == "loc buffer rewritten in place (it tracks no version: the kind of write is unknown)"
