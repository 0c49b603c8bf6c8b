"""The translation cache's contract (docs/translation-rules.md): each hazard is detected, classified and survived."""

from contextlib import contextmanager

import pytest
import torch

from runtime.faults import Faults

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
    assert event.classification == "stale_loc" and event.cause == "mapping changed at set_mapping"


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
        assert event.cause.startswith("loc buffer rewritten in place by a write no version counter sees")


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
