"""The scheduler with the prefix cache on, without a model: real pools, host tier and radix tree; a stand-in for
the engine answers with tokens that depend only on the ids so far. Every step the slot accounting is checked:
the pools hold exactly the cache's nodes plus each running request's own slots (those after its held prefix),
and the mapped SWA slots are the cache's windows plus each request's own in-window slots."""

import pytest
import torch
from test_scheduler_unit import WINDOW, expected_output, make, token_for  # the same pools and stand-in model

from runtime.core import Req, SamplingParams
from runtime.scheduler.scheduler import Scheduler


def check_accounting(s: Scheduler) -> None:
    tree, slots, ps = s.slots.tree, s.slots, s.slots.page_size
    held = {r: s.holds[r].length if r in s.holds else 0 for r in s.running}
    device = [n for n in tree.nodes() if n.on_device]
    full = [loc for n in device for loc in n.locs] + [loc for r in s.running for loc in r.locs[held[r]:]]
    assert len(full) == len(set(full))
    assert slots.allocator.full.used_size() == len({loc // ps for loc in full}) * ps
    in_window = [loc for r in s.running for loc in r.locs[max(r.swa_released_upto, held[r]):]]
    in_window += [loc for n in device if n.swa for loc in n.locs]
    mapping = slots.allocator.full_to_swa_index_mapping
    assert slots.mapped_count() == len(in_window) and bool((mapping[torch.tensor(in_window or [0])] > 0).all())
    swa = {int(mapping[loc]) // ps for loc in in_window}
    assert slots.allocator.swa.used_size() == len(swa) * ps
    held = {loc for r in s.holds for loc in s.holds[r].locs}
    assert tree.locked_tokens == len(held)  # exactly the held prefixes are locked
    for r, m in s.holds.items():
        assert r.locs[:m.length] == list(m.locs)  # the head of Req.locs is the cache's slots
    offloaded = sum(r.offloaded.num_tokens for r in s.waiting if r.offloaded is not None)
    assert slots.host_used == tree.host_tokens + offloaded
    usage = slots.usage()
    assert usage["full", "used"] + usage["full", "available"] == usage["full", "total"]


def run(s: Scheduler, reqs: list[Req], max_steps=10_000) -> list:
    for r in reqs:
        s.add(r)
    batches = []
    for _ in range(max_steps):
        batch = s.schedule()
        if batch is None:
            break
        assert len(set(batch.out_locs)) == len(batch.out_locs) and 0 not in batch.out_locs
        batches.append(batch)
        s.process(batch, [token_for(batch.reqs[i]) for i in batch.sample])
        check_accounting(s)
    assert all(r.done for r in reqs)
    return batches


def prompt(n, seed):
    return torch.randint(4, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_shared_prefix_is_prefilled_once_and_held_by_every_request_that_uses_it():
    s, stats = make(prefix_cache=True)
    system = prompt(40, 1)
    run(s, [Req(system, SamplingParams(max_new_tokens=1))])  # caches the 40 tokens, SWA for their last window
    a, b = (Req(system + prompt(6, seed), SamplingParams(max_new_tokens=12)) for seed in (3, 4))
    s.add(a)
    s.add(b)
    batch = s.schedule()
    # both admitted on a 40-token hit: they share the cache's slots for it and prefill only their own tokens
    assert batch.prefix_lens == (40, 40) and batch.seq_lens == (46, 46) and batch.fresh_rows == (True, True)
    assert a.locs[:40] == b.locs[:40]
    assert s.holds[a].node is s.holds[b].node and s.holds[a].node.lock == 2
    assert stats.prefix_cache.queried_tokens == 40 + 46 + 46 and stats.prefix_cache.hit_tokens == 80
    s.process(batch, [token_for(batch.reqs[i]) for i in batch.sample])
    run(s, [])
    assert a.output_ids == expected_output(a.prompt_ids, 12) and b.output_ids == expected_output(b.prompt_ids, 12)
    s.assert_idle_clean()


def test_window_eviction_never_frees_a_slot_the_cache_owns():
    s, _ = make(prefix_cache=True)
    system = prompt(30, 5)
    run(s, [Req(system, SamplingParams(max_new_tokens=1))])
    shared_window, longest = None, 0
    a = Req(system + prompt(3, 6), SamplingParams(max_new_tokens=20))
    b = Req(system + prompt(3, 7), SamplingParams(max_new_tokens=4))
    s.add(a)
    s.add(b)
    while (batch := s.schedule()) is not None:
        s.process(batch, [token_for(batch.reqs[i]) for i in batch.sample])
        check_accounting(s)
        if a in s.holds:
            m = s.holds[a]
            shared_window = s.slots.allocator.full_to_swa_index_mapping[torch.tensor(list(m.locs[-WINDOW + 1:]))]
            # a's window has moved far past the shared prefix; the prefix's last window is still mapped
            assert bool((shared_window > 0).all()) and a.swa_released_upto >= 30
            longest = max(longest, a.cached)
    assert shared_window is not None and longest > 30 + WINDOW
    s.assert_idle_clean()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("hicache", [0, 4096])
def test_multi_turn_chats_that_outgrow_the_pools_hit_evict_and_stay_correct(page_size, hicache):
    # Five conversations, four turns each; the full pool holds about two of them.
    s, stats = make(prefix_cache=True, full=160, ratio=0.5, chunk=16, running=4, hicache=hicache, page_size=page_size)
    history = {c: prompt(12, 10 + c) for c in range(5)}
    for turn in range(4):
        reqs = {c: Req(list(h), SamplingParams(max_new_tokens=6)) for c, h in history.items()}
        run(s, list(reqs.values()))
        for c, r in reqs.items():
            assert r.output_ids == expected_output(r.prompt_ids, 6)
            history[c] = r.all_ids() + prompt(5, 100 * turn + c)
    pc, tree = stats.prefix_cache, s.slots.tree
    assert 0 < pc.hit_tokens < pc.queried_tokens
    assert tree.evictions > 0 and pc.evicted_tokens["full"] > 0
    if hicache:
        assert tree.loadbacks > 0 and stats.hicache_bytes["loadback"] > 0
        assert stats.translation.invalidation_counts["prefix_loadback"] > 0
    else:
        assert tree.host_tokens == 0 and stats.hicache_bytes["offload"] == 0
    s.assert_idle_clean()


@pytest.mark.parametrize("hicache", [0, 4096])
def test_retracting_a_request_that_holds_a_prefix_releases_it_and_outputs_stay_right(hicache):
    s, stats = make(prefix_cache=True, full=96, ratio=0.5, chunk=32, running=4, hicache=hicache)
    system = prompt(24, 8)
    run(s, [Req(system, SamplingParams(max_new_tokens=1))])
    reqs = [Req(system + prompt(n, 20 + n), SamplingParams(max_new_tokens=16)) for n in (4, 6, 8, 10)]
    run(s, reqs)
    assert sum(stats.retraction_counts.values()) > 0
    assert stats.prefix_cache.hit_tokens >= 24 * 4
    for r in reqs:
        assert r.output_ids == expected_output(r.prompt_ids, 16)
    s.assert_idle_clean()


def test_a_prompt_entirely_in_the_cache_still_prefills_its_last_token_for_the_logits():
    s, stats = make(prefix_cache=True)
    ids = prompt(20, 9)
    run(s, [Req(ids, SamplingParams(max_new_tokens=1))])  # caches the 20 prompt tokens (the sampled one has no KV)
    again = Req(list(ids), SamplingParams(max_new_tokens=3))  # the same prompt again (a retry, a regeneration)
    s.add(again)
    batch = s.schedule()
    assert (batch.prefix_lens, batch.seq_lens, batch.sample) == ((19,), (20,), (0,))
    s.process(batch, [token_for(again)])
    run(s, [])
    assert again.output_ids == expected_output(again.prompt_ids, 3)
    s.assert_idle_clean()


def test_an_aborted_request_releases_its_prefix_and_caches_nothing():
    s, _ = make(prefix_cache=True)
    system = prompt(20, 11)
    run(s, [Req(system, SamplingParams(max_new_tokens=1))])
    cached = s.slots.tree.device_tokens
    r = Req(system + prompt(4, 12), SamplingParams(max_new_tokens=10))
    s.add(r)
    for _ in range(3):
        batch = s.schedule()
        s.process(batch, [token_for(batch.reqs[i]) for i in batch.sample])
    assert r in s.holds and s.abort(r.rid)
    assert not s.holds and s.slots.tree.device_tokens == cached
    check_accounting(s)
    s.assert_idle_clean()
