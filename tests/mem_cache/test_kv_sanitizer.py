"""The KV sanitizer (docs/kv-sanitizer.md): realistic slips that make a KV location wrong while the mapping
and the translation cache agree, each patched into the real code, on the tiny model.

For each: the right classification is counted at the right site, the event names the code path that last
allocated, freed or moved the slot, and in the strict setting the event is counted in the very forward that
first reads or writes the wrong slot. That forward is found by a spy that knows the slip (the scheduler's own
record of each request's slots, the mapping, the allocator), never by the ledger under test. A clean run in
every configuration counts nothing.
"""

import pytest
import torch

from kv_slips import (  # tests/ is on sys.path
    backend_caches_swa_write_loc_by_address,
    fresh_rows_not_rewritten,
    loadback_compacts_without_hooks,
    locked_nodes_evictable,
    padding_not_reset,
    partial_pages_released,
    verify_padding_not_reset,
    window_released_one_token_early,
)
from runtime import kernels
from runtime.attention.base import AttentionBackend
from runtime.config import EngineConfig
from runtime.context import get_forward_context
from runtime.core import Req, SamplingParams
from runtime.engine import Engine
from runtime.mem_cache import sanitizer
from runtime.models.config import Gemma3Config
from runtime.models.loader import build_model, random_state_dict
from runtime.models.tokenizer import ByteTokenizer
from telemetry.names import NON_BENIGN_CLASSIFICATIONS

W = 8
CONFIG = Gemma3Config.tiny(sliding_window=W)
STATE = random_state_dict(CONFIG, seed=3)
GEN = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(4, 260, (n,), generator=GEN).tolist() for n in (5, 14, 23, 9, 30, 17)]
# different lengths, so that decode batches shrink while their graph size stays (padding appears)
PARAMS = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 3, 9, 16, 5, 7)]
# something to copy, so that speculation drafts (verify batches of varying draft lengths)
SPEC_PROMPTS = [[2] + [10, 11, 12, 13, 14, 15] * 6, [2] + list(range(40, 60)) * 2, [2, 5, 6, 7, 8, 9, 5, 6, 7]]


def engine(**cfg):
    base = dict(model="tiny", max_total_tokens=1024, swa_full_tokens_ratio=0.5, chunked_prefill_size=16,
                max_running_requests=8, graph_batch_sizes=(1, 2, 4, 8), kv_sanitizer="strict")
    base.update(cfg)
    return Engine(EngineConfig(**base), model=build_model(CONFIG, STATE, torch.float32), tokenizer=ByteTokenizer(),
                  progress=False)


def bad_events(e):
    return {k: v for k, v in e.stats.translation.key_change_counts.items() if v and k[1] in NON_BENIGN_CLASSIFICATIONS}


def first_event(e, site, classification):
    return next(x for x in e.reporter.first_events() if (x.site, x.classification) == (site, classification))


class Spy:
    """Records the first forward whose metadata shows the slip, by a predicate (engine, batch, meta) -> bool
    evaluated after the backend built the forward's metadata (and before any layer reads or writes)."""

    def __init__(self, monkeypatch, predicate):
        self.first = None
        self.engine = None
        original = AttentionBackend.init_forward_metadata
        spy = self

        def init_forward_metadata(backend, batch):
            original(backend, batch)
            if spy.first is None and spy.engine is not None and predicate(spy.engine, batch, backend.meta):
                spy.first = get_forward_context().forward_id

        monkeypatch.setattr(AttentionBackend, "init_forward_metadata", init_forward_metadata)


@pytest.fixture(params=["torch", "fused"])
def write_check(request, monkeypatch):
    """The sanitizer's write check both ways: the torch checks alone, or first the fused kernels' one-call check
    (`writes_owned`, which must leave every slip to them)."""
    if request.param == "torch":
        monkeypatch.setattr(sanitizer.kernels, "loaded", lambda: None)
    else:
        assert kernels.load() is not None, f"the fused CPU kernels did not build: {kernels.failure()}"
    return request.param


def real_entries(batch):
    return [b for b, row in enumerate(batch.req_rows) if row != 0]


def window_reads_unmapped(engine, batch, meta):
    """A real request's sliding-window keys include the sink: a position whose SWA side is gone."""
    keys = meta.swa
    ptr = keys.indptr_list
    return any(bool((keys.indices[ptr[b]:ptr[b + 1]] == 0).any()) for b in real_entries(batch))


# ---- 1. graph-replay padding ----------------------------------------------------------------------------------
def padded_entry_writes_a_live_slot(engine, batch, meta):
    return any(int(batch.out_cache_loc[b]) != 0 for b, row in enumerate(batch.req_rows) if row == 0)


def test_graph_padding_not_reset_is_a_foreign_write_in_the_first_replay_that_pads(monkeypatch, write_check):
    padding_not_reset(monkeypatch)
    spy = Spy(monkeypatch, padded_entry_writes_a_live_slot)
    e = spy.engine = engine(disable_prefix_caching=True)
    e.generate(PROMPTS, PARAMS)
    assert spy.first is not None, "the workload never padded over a stale row"
    assert bad_events(e) == {("kv_write", "foreign_slot_write"): bad_events(e)["kv_write", "foreign_slot_write"]}
    event = first_event(e, "kv_write", "foreign_slot_write")
    assert event.forward_id == spy.first and event.mode == "graph_replay"
    assert event.expected_owner.startswith("the padding sink (slot 0)")
    assert event.pool == "full" and event.slot > 0 and "position" in event.actual_owner
    assert event.last_path.startswith("Scheduler._batch via KVSlots.claim"), event.last_path  # who handed it out


def padded_verify_token_writes_a_live_slot(engine, batch, meta):
    rows = torch.repeat_interleave(torch.tensor(batch.req_rows), torch.tensor(batch.extend_lens))  # (T,)
    return batch.verify and bool((batch.out_cache_loc[rows == 0] != 0).any())


def test_verify_padding_not_reset_is_a_foreign_write_in_the_first_verify_replay_that_pads(monkeypatch, write_check):
    """A verify replay packs each request's last token and draft, then pads the tail of its (batch size, K)
    buffers: a tail left from a longer verify writes the slots that verify's tokens were given."""
    verify_padding_not_reset(monkeypatch)
    spy = Spy(monkeypatch, padded_verify_token_writes_a_live_slot)
    e = spy.engine = engine(disable_prefix_caching=True, speculative_algorithm="ngram", num_speculative_tokens=4)
    e.generate(SPEC_PROMPTS, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert spy.first is not None, "the workload never padded a verify over a stale tail"
    assert set(bad_events(e)) == {("kv_write", "foreign_slot_write")}
    event = first_event(e, "kv_write", "foreign_slot_write")
    assert event.forward_id == spy.first and event.mode == "target_verify"
    assert event.expected_owner.startswith("the padding sink (slot 0)")
    assert event.pool == "full" and event.slot > 0
    assert event.last_path.startswith("Scheduler."), event.last_path  # handed out, or rolled back, by it


def test_the_same_workload_without_the_slip_counts_nothing():
    e = engine(disable_prefix_caching=True, speculative_algorithm="ngram", num_speculative_tokens=4)
    e.generate(SPEC_PROMPTS, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert e.runner.verify_graphs.path_counts["verify_replay_padded"] > 0 and bad_events(e) == {}


# ---- 2. stale request-table rows after a load-back -----------------------------------------------------------
def table_row_disagrees_with_the_scheduler(engine, batch, meta):
    by_row = {r.row: r for r in engine.scheduler.running}
    table = engine.runner.req_to_token.req_to_token
    for b in real_entries(batch):
        r, p = by_row[batch.req_rows[b]], batch.prefix_lens[b]
        if table[r.row, :p].tolist() != r.locs[:p]:
            return True
    return False


def test_a_row_not_rewritten_after_a_load_back_reads_slots_the_request_no_longer_owns(monkeypatch):
    fresh_rows_not_rewritten(monkeypatch)
    spy = Spy(monkeypatch, table_row_disagrees_with_the_scheduler)
    e = spy.engine = engine(max_total_tokens=96, hicache_size=4096, disable_prefix_caching=True)
    e.generate(PROMPTS, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert e.stats.hicache_loadbacks > 0 and spy.first is not None
    reads = {k for k in bad_events(e) if k[0] == "kv_read"}
    assert reads and reads <= {("kv_read", "foreign_slot_read"), ("kv_read", "freed_slot_read")}
    firsts = [first_event(e, *k) for k in reads]
    assert min(x.forward_id for x in firsts) == spy.first and {x.pool for x in firsts} == {"full"}
    for x in firsts:  # a stale slot handed to another request, or a position the new row never had (the sink)
        assert x.expected_owner.startswith("request req-") and "position" in x.expected_owner
        assert "Scheduler." in x.last_path or x.actual_owner == "the reserved padding sink (never allocated)"
    assert any("Scheduler." in x.last_path for x in firsts)


def test_a_stale_row_holding_another_cached_prefix_is_a_foreign_read_though_the_cache_owns_that_position(
        monkeypatch):
    """A row reused without being rewritten still lists the previous request's slots, which the prefix cache
    took when it finished: the cache owns them at the very positions read, so only the new request's own
    prefix match says they are not its."""
    e = engine(max_running_requests=1, graph_batch_sizes=(1,))  # one row: every request gets row 1
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    e.generate([PROMPTS[4][:24]], params)  # the prefix the last request will match
    e.generate([PROMPTS[2]], params)  # 23 other tokens, then cached: row 1 lists its slots, now the cache's
    assert bad_events(e) == {}
    fresh_rows_not_rewritten(monkeypatch)
    e.generate([PROMPTS[4][:24] + PROMPTS[0]], params)  # matches the first prefix; row 1 keeps the second's
    assert e.stats.prefix_cache.hit_tokens > 0
    assert set(bad_events(e)) == {("kv_read", "foreign_slot_read")}
    event = first_event(e, "kv_read", "foreign_slot_read")
    assert event.pool == "full" and event.actual_owner.startswith("the prefix cache, position")
    assert event.actual_owner.split()[-1] == event.expected_owner.split()[-1]  # the same position: only the match differs
    assert "RadixCache." in event.last_path and "KVSlots.to_tree" in event.last_path, event.last_path  # the cache took it


# ---- 3. SWA freed while still in a window ---------------------------------------------------------------------
@pytest.mark.parametrize("slip, page_size, freed_by", [
    (window_released_one_token_early, 1, "_release_window via KVSlots.free_swa"),  # the patched scheduler method
    (partial_pages_released, 4, "free_swa via PagedAllocator.free"),  # the patched allocator method
])
def test_swa_released_inside_a_window_is_a_freed_read_in_the_first_forward_that_reads_it(monkeypatch, slip,
                                                                                          page_size, freed_by):
    slip(monkeypatch)
    spy = Spy(monkeypatch, window_reads_unmapped)
    e = spy.engine = engine(page_size=page_size, disable_prefix_caching=True)
    e.generate(PROMPTS, PARAMS)
    assert spy.first is not None
    assert set(bad_events(e)) == {("kv_read", "freed_slot_read")}
    event = first_event(e, "kv_read", "freed_slot_read")
    assert event.forward_id == spy.first and event.pool == "swa" and event.slot == 0
    assert "SWA side was freed" in event.actual_owner
    assert freed_by in event.last_path, event.last_path


def free_last_swa_side_then_offload(e):
    """A decoding request's newest token loses its SWA slot (freed by a plain call here, still in the window),
    then the host tier copies the request: what the offload of a retraction does."""
    r = Req(PROMPTS[4], SamplingParams(max_new_tokens=8, ignore_eos=True))
    e.scheduler.add(r)
    while len(r.output_ids) < 3:
        e.step()
    freed_at = e.runner.last_forward_id
    e.scheduler.slots.free_swa(r.locs[-1:])
    swa_from = e.scheduler._window_start(r)
    return r, freed_at, e.scheduler.slots.offload(r.locs, swa_from)


def test_an_offload_of_a_token_whose_swa_side_was_freed_is_a_freed_read_and_the_engine_goes_on():
    e = engine(disable_prefix_caching=True, kv_sanitizer="sampled")  # offloads are checked in every mode
    r, freed_at, host = free_last_swa_side_then_offload(e)
    assert set(bad_events(e)) == {("kv_read", "freed_slot_read")}
    event = first_event(e, "kv_read", "freed_slot_read")
    assert event.pool == "swa" and event.slot == 0 and "copied to the host tier" in event.expected_owner
    assert f"position {len(r.locs) - 1}" in event.expected_owner and f"(row {r.row})" in event.expected_owner
    assert "free_last_swa_side_then_offload via KVSlots.free_swa" in event.last_path, event.last_path
    assert f"(forward {freed_at})" in event.last_path
    assert host.num_tokens == len(r.locs)  # the copy was made (the sink's row for the lost token)
    e.scheduler.slots.drop(host)


def test_without_the_sanitizer_an_offload_of_an_unmapped_window_token_still_stops():
    e = engine(disable_prefix_caching=True, kv_sanitizer="off")
    with pytest.raises(RuntimeError, match="in-window token has no SWA slot"):
        free_last_swa_side_then_offload(e)


def test_evicting_a_locked_prefix_node_is_a_bad_read_naming_the_eviction(monkeypatch):
    evicted: set = set()
    locked_nodes_evictable(monkeypatch, evicted)

    def reads_evicted(engine, batch, meta):  # a request in the batch holds a prefix through an evicted node
        rows = {batch.req_rows[b] for b in real_entries(batch)}
        for r, hold in engine.scheduler.holds.items():
            node = hold.node
            while r.row in rows and node is not None:
                if node in evicted:
                    return True
                node = node.parent
        return False

    spy = Spy(monkeypatch, reads_evicted)
    e = spy.engine = engine(max_total_tokens=96, hicache_size=0)
    shared = PROMPTS[4][:24]
    e.generate([shared], SamplingParams(max_new_tokens=2, ignore_eos=True))  # cached: 24 tokens (a node)
    others = [PROMPTS[1] + PROMPTS[3] + PROMPTS[0], PROMPTS[2] + PROMPTS[5]]
    reqs = [Req(p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in [shared + PROMPTS[0]] + others]
    for r in reqs:
        e.scheduler.add(r)
    for _ in range(60):  # the broken tree need not let them all finish: step until the bad read is seen
        if spy.first is not None or not e.step():
            break
    assert evicted and spy.first is not None
    reads = {k for k in bad_events(e) if k[0] == "kv_read"}
    assert reads, bad_events(e)
    first = min((first_event(e, *k) for k in reads), key=lambda x: x.forward_id)
    assert first.forward_id == spy.first
    assert first.pool == "full" and first.expected_owner.endswith(f"position {first.expected_owner.split()[-1]}")
    # the slot went back through the eviction (then maybe to another request): the eviction is on the path
    assert "RadixCache._evict via KVSlots.free" in first.last_path or "Scheduler." in first.last_path, first.last_path


# ---- 4. a translation cached outside the translator ------------------------------------------------------------
def test_a_backend_caching_its_swa_write_location_by_address_is_a_foreign_write(monkeypatch, write_check):
    backend_caches_swa_write_loc_by_address(monkeypatch)

    def stale_write_loc(engine, batch, meta):
        fresh = engine.pool.allocator.full_to_swa_index_mapping[batch.out_cache_loc]
        return not torch.equal(meta.swa_out_loc.long(), fresh)

    spy = Spy(monkeypatch, stale_write_loc)  # installed after the slip: it sees the slip's metadata
    e = spy.engine = engine(disable_prefix_caching=True)
    e.generate(PROMPTS[:2], PARAMS[:2])
    assert spy.first is not None
    assert ("kv_write", "foreign_slot_write") in bad_events(e)
    event = first_event(e, "kv_write", "foreign_slot_write")
    assert event.forward_id == spy.first and event.pool == "swa"
    assert event.expected_owner.startswith("the token at full slot")
    assert "Scheduler._plan_" in event.last_path or "via" in event.last_path, event.last_path


# ---- 5. an unhooked mapping write laundered by a load-back -----------------------------------------------------
def test_an_unhooked_write_before_a_load_back_is_counted_there_and_its_read_is_foreign(monkeypatch):
    moved: dict = {}
    loadback_compacts_without_hooks(monkeypatch, moved)

    def reads_moved(engine, batch, meta):
        return bool(moved) and bool((meta.swa.indices == moved["swa"]).any())

    spy = Spy(monkeypatch, reads_moved)
    e = spy.engine = engine(max_total_tokens=96, hicache_size=4096, disable_prefix_caching=True)
    e.generate(PROMPTS, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert moved and e.stats.hicache_loadbacks > 0
    events = bad_events(e)
    assert events["register_mapping", "stale_loc"] == 1
    laundered = first_event(e, "register_mapping", "stale_loc")
    assert laundered.cause.startswith("mapping changed outside every hooked mutation: written in place")
    assert f"first at full slot {moved['full']}" in laundered.cause
    assert "found by the load-back at register_mapping after forward" in laundered.cause
    assert "test_kv_sanitizer.py" in laundered.stack and "load_back" in laundered.stack
    assert spy.first is not None  # the moved token is read again: its SWA slot belongs to nobody
    read = first_event(e, "kv_read", "foreign_slot_read")
    assert read.forward_id == spy.first and read.slot == moved["swa"]
    assert read.actual_owner == "allocated, not handed to any token"
    assert "load_back via PagedAllocator.alloc" in read.last_path, read.last_path  # the compaction's


# ---- a clean build counts nothing ------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("cfg", [
    # prefix cache over the host tier, pools small enough to retract by offload, evict and tombstone nodes
    dict(max_total_tokens=96, hicache_size=4096),
    dict(max_total_tokens=96, hicache_size=0, disable_prefix_caching=True),  # retraction by recompute
])
def test_a_clean_run_in_strict_mode_counts_no_sanitizer_event(page_size, cfg):
    e = engine(page_size=page_size, **cfg)
    e.generate(PROMPTS, PARAMS)
    e.generate(PROMPTS[:3] + [PROMPTS[0] + PROMPTS[1]], SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert bad_events(e) == {}
    assert e.runner.branch_counts["graph_replay"] > 0 and e.runner.branch_counts["eager_extend"] > 0
    e.scheduler.assert_idle_clean()
