"""The scheduler on its own: real pools and host tier, no model. A stand-in for the engine feeds `process()`
tokens that depend only on the request's ids, and every step the slot accounting is checked against the
requests' own records: full slots held = tokens cached, SWA slots held = tokens still in some window.
Nothing of the model side is imported (`test_no_model_code_is_imported` checks it in a fresh interpreter)."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from runtime.config import EngineConfig
from runtime.core import Req, RequestError, SamplingParams
from runtime.mem_cache.hicache import HostKVCache
from runtime.mem_cache.slots import KVSlots
from runtime.mem_cache.swa_pool import build_hybrid_kv_pool
from runtime.scheduler.scheduler import Scheduler
from telemetry.stats import EngineStats

WINDOW = 8
# What EngineConfig.resolve reads of a model config, with Gemma3Config.tiny's values: the scheduler needs no
# model, not even its config class (importing runtime.models would pull in the model and layer code).
MODEL = SimpleNamespace(sliding_window=WINDOW, sliding_layer_ids=(0, 1, 3, 4), full_layer_ids=(2, 5),
                        max_position_embeddings=1024, vocab_size=260, num_key_value_heads=2, head_dim=16)


def make(full=256, ratio=0.5, chunk=16, running=4, hicache=0, page_size=1, prefix_cache=False):
    rc = EngineConfig(model="tiny", max_total_tokens=full, swa_full_tokens_ratio=ratio, page_size=page_size,
                      chunked_prefill_size=chunk, max_running_requests=running, hicache_size=hicache).resolve(MODEL)
    stats = EngineStats("memo")
    pool = build_hybrid_kv_pool(full_size=rc.full_pool_size, swa_size=rc.swa_pool_size, page_size=page_size,
                                layer_is_swa=[True, False], num_kv_heads=1, head_dim=2, dtype=torch.float32,
                                policy="memo", stats=stats.translation, reporter=None)
    slots = KVSlots(pool.allocator, HostKVCache(pool, hicache, stats), prefix_cache=prefix_cache, window=WINDOW,
                    stats=stats.prefix_cache)
    return Scheduler(rc, slots, stats, eos_ids=[1]), stats


def token_for(req: Req) -> int:
    """What a deterministic model would answer: a function of the ids so far (never EOS)."""
    return 4 + (sum(req.all_ids()) * 31 + len(req.all_ids())) % 200


def check_accounting(s: Scheduler) -> None:
    usage = s.slots.usage()
    held = [r for r in s.running]
    assert usage["full", "used"] == sum(r.cached for r in held)
    in_window = sum(r.cached - r.swa_released_upto for r in held)
    assert usage["swa", "used"] == in_window == s.slots.mapped_count()
    assert len(s.free_rows) + len(held) == s.max_running
    assert s.slots.host_used == sum(r.offloaded.num_tokens for r in s.waiting if r.offloaded is not None)


def run(s: Scheduler, max_steps=10_000) -> list:
    """Step like the engine does (schedule -> 'forward' -> process) until idle; the batches seen."""
    batches = []
    for _ in range(max_steps):
        batch = s.schedule()
        if batch is None:
            break
        assert len(batch.out_locs) == sum(q - p for p, q in zip(batch.prefix_lens, batch.seq_lens))
        assert len(set(batch.out_locs)) == len(batch.out_locs) and 0 not in batch.out_locs
        batches.append(batch)
        s.process(batch, [token_for(batch.reqs[i]) for i in batch.sample])
        check_accounting(s)
    return batches


def reqs(lens, new=6):
    gen = torch.Generator().manual_seed(sum(lens))
    return [Req(torch.randint(4, 200, (n,), generator=gen).tolist(), SamplingParams(max_new_tokens=new)) for n in lens]


def expected_output(prompt: list[int], new: int) -> list[int]:
    r = Req(list(prompt), SamplingParams(max_new_tokens=new))
    for _ in range(new):
        r.output_ids.append(token_for(r))
    return r.output_ids


def test_admission_is_bounded_by_request_rows_and_the_rest_waits():
    s, stats = make(running=2)
    rs = reqs([5, 6, 7, 8])
    for r in rs:
        s.add(r)
    first = s.schedule()
    assert [r.status for r in rs] == ["running", "running", "waiting", "waiting"]
    assert first.reqs == tuple(rs[:2]) and not first.is_decode and first.fresh_rows == (True, True)
    assert {r.row for r in rs[:2]} == {1, 2} and s.free_rows == []
    assert stats.prompt_tokens == 5 + 6  # counted at admission
    s.process(first, [token_for(first.reqs[i]) for i in first.sample])
    run(s)
    assert [r.output_ids for r in rs] == [expected_output(r.prompt_ids, 6) for r in rs]
    assert stats.request_counts["finished"] == 4 and stats.prompt_tokens == 5 + 6 + 7 + 8
    s.assert_idle_clean()


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_after_the_last_chunk():
    s, _ = make(chunk=8)
    (r,) = rs = reqs([23])
    s.add(r)
    batches = run(s)
    prefill = [b for b in batches if not b.is_decode]
    assert [(b.prefix_lens, b.seq_lens, b.sample) for b in prefill] == [((0,), (8,), ()), ((8,), (16,), ()),
                                                                        ((16,), (23,), (0,))]
    assert prefill[0].fresh_rows == (True,) and prefill[1].fresh_rows == (False,)
    assert prefill[0].positions() == list(range(8)) and prefill[2].input_ids() == r.prompt_ids[16:23]
    decode = [b for b in batches if b.is_decode]
    assert len(decode) == 5 and all(b.seq_lens == (b.prefix_lens[0] + 1,) for b in decode)
    assert r.output_ids == expected_output(r.prompt_ids, 6)
    s.assert_idle_clean()


def test_window_eviction_keeps_only_the_last_window_minus_one_tokens_in_the_swa_pool():
    s, stats = make(chunk=64)
    (r,) = reqs([30], new=20)
    s.add(r)
    swa_held = []
    while (batch := s.schedule()) is not None:
        s.process(batch, [token_for(batch.reqs[i]) for i in batch.sample])
        if not r.done:
            swa_held.append((r.cached, s.slots.usage()["swa", "used"]))
    # after a forward that leaves c tokens cached, the next query (position c) sees positions c-W+1..c
    assert all(held == min(c, WINDOW - 1) for c, held in swa_held)
    assert stats.swa_evicted_tokens == (30 + 19) - (WINDOW - 1)  # every token but the last window's, at finish
    s.assert_idle_clean()


@pytest.mark.parametrize("hicache", [0, 4096])
def test_decode_under_pool_pressure_retracts_the_newest_to_host_or_recomputes_and_outputs_match(hicache):
    lens = [20, 24, 18, 22]
    s, stats = make(full=96, ratio=0.5, chunk=32, running=4, hicache=hicache)
    rs = reqs(lens, new=12)
    for r in rs:
        s.add(r)
    batches = run(s)
    assert [r.output_ids for r in rs] == [expected_output(r.prompt_ids, 12) for r in rs]
    if hicache:
        assert stats.hicache_offloads > 0 and stats.hicache_loadbacks == stats.hicache_offloads
        assert stats.retraction_counts == {"offload": stats.hicache_offloads, "recompute": 0, "other": 0}
        assert s.slots.allocator.mapping_generation == stats.hicache_loadbacks  # one registered rebuild each
        reloaded = [b for b in batches if any(b.fresh_rows) and b.prefix_lens[b.fresh_rows.index(True)] > 0]
        assert reloaded, "a loaded-back request must come back on a fresh row with its cached prefix"
    else:
        assert stats.hicache_offloads == 0 and stats.retraction_counts["offload"] == 0
        assert stats.retraction_counts["recompute"] > 0
        recomputed = sum(b.num_tokens for b in batches if not b.is_decode) - sum(lens)
        assert recomputed > 0  # the retracted requests' prompts and outputs were prefilled again
    s.assert_idle_clean()


def test_abort_of_running_and_waiting_requests_frees_every_slot():
    s, stats = make(running=2)
    rs = reqs([10, 12, 9])
    for r in rs:
        s.add(r)
    for _ in range(3):
        batch = s.schedule()
        s.process(batch, [token_for(batch.reqs[i]) for i in batch.sample])
    assert rs[2].status == "waiting" and rs[0].cached > 0
    assert s.abort(rs[0].rid) and s.abort(rs[2].rid, status="error", reason="error", message="boom")
    assert not s.abort(rs[0].rid)  # twice: no-op
    assert (rs[0].status, rs[0].finish_reason) == ("aborted", "abort")
    assert (rs[2].status, rs[2].finish_reason, rs[2].error) == ("error", "error", "boom")
    check_accounting(s)
    run(s)
    assert rs[1].status == "finished"
    assert stats.request_counts["aborted"] == 1 and stats.request_counts["finished"] == 1
    s.assert_idle_clean()


def test_requests_that_can_never_be_served_are_rejected_before_anything_is_held():
    s, stats = make(full=64)
    with pytest.raises(RequestError, match="empty prompt"):
        s.add(Req([], SamplingParams()))
    with pytest.raises(RequestError, match="token ids"):
        s.add(Req([5, 999], SamplingParams()))
    with pytest.raises(RequestError, match="full pool holds 64"):
        s.add(Req(list(range(4, 60)), SamplingParams(max_new_tokens=8)))
    assert stats.request_counts["rejected"] == 3
    s.assert_idle_clean()


def test_no_model_code_is_imported():
    """These tests (and the prefix-cache ones built on them) import no model, layer, attention, executor or
    sampling code: run in a fresh interpreter, importing this module loads none of it."""
    here = Path(__file__).resolve()
    probe = ("import sys; sys.path[:0] = [%r, %r]; import test_scheduler_unit, test_prefix_cache_unit; "
             "print(' '.join(m for m in sys.modules if m.split('.')[:2] in (['runtime', 'models'], "
             "['runtime', 'layers'], ['runtime', 'attention'], ['runtime', 'executor'], ['runtime', 'engine'])))"
             % (str(here.parents[2]), str(here.parent)))
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == []
