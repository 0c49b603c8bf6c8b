"""Speculative verify forwards replayed over static buffers per (batch size, K): captured at start-up only when
speculating, the live batch copied in at stable addresses and padded to the sink, the logits those of the
live tokens exactly as an eager verify computes them, an eager fallback beyond the largest batch size, and
the forward-entry invalidation before every replay (float32, tiny model)."""

import pytest
import torch

from runtime.attention.base import AttentionBackend
from runtime.config import EngineConfig
from runtime.context import get_forward_context
from runtime.core import SamplingParams
from runtime.diagnose.driver import Driver
from runtime.diagnose.workload import PhaseOutput, Workload, reserved_verify_phase
from runtime.engine import Engine
from runtime.executor.graph_runner import WARMUP_RUNS
from runtime.models.config import Gemma3Config
from runtime.models.loader import build_model, random_state_dict
from runtime.models.tokenizer import ByteTokenizer
from telemetry.names import NON_BENIGN_CLASSIFICATIONS

CONFIG = Gemma3Config.tiny()
STATE = random_state_dict(CONFIG, seed=0)
K = 4
# repetitive prompts (something to copy) and one with nothing repeated
PROMPTS = [[2] + [10, 11, 12, 13, 14, 15] * 6, [2] + list(range(40, 60)) * 2, [2, 5, 6, 7, 8, 9, 5, 6, 7],
           [2] + [(i * 37) % 250 + 4 for i in range(30)]]
WORK = Workload(window=CONFIG.sliding_window, vocab=CONFIG.vocab_size)


def engine(**overrides) -> Engine:
    cfg = dict(model="tiny", dtype="float32", quantization="none", max_total_tokens=4096, swa_full_tokens_ratio=0.25,
               max_running_requests=8, chunked_prefill_size=64, graph_batch_sizes=(1, 2, 4),
               speculative_algorithm="ngram", num_speculative_tokens=K, kv_sanitizer="strict")
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg), progress=False, model=build_model(CONFIG, STATE, torch.float32),
                  tokenizer=ByteTokenizer())


def bad_events(e):
    return {k: n for k, n in e.stats.translation.key_change_counts.items() if n and k[1] in NON_BENIGN_CLASSIFICATIONS}


def test_start_up_captures_a_verify_graph_per_batch_size_only_when_speculating():
    e = engine(graph_batch_sizes=(1, 2, 4, 16))
    verify = e.runner.verify_graphs
    assert verify.batch_sizes == (1, 2, 4)  # 16 > max_running_requests: no batch of that size can form
    assert {bs: b.out_cache_loc.numel() for bs, b in verify.buffers.items()} == {1: 5, 2: 10, 4: 20}
    assert e.runner.branch_counts["graph_capture"] == (WARMUP_RUNS + 1) * 6  # three decode sizes, three verify
    assert bad_events(e) == {}
    for off in (dict(speculative_algorithm="none"), dict(graphs=False)):
        assert engine(**off).runner.verify_graphs is None


def test_verify_batches_replay_over_buffers_whose_addresses_never_change(monkeypatch):
    seen = []  # (tokens, addresses of input_ids, positions, out_cache_loc, live requests) of every verify forward
    original = AttentionBackend.init_forward_metadata

    def init_forward_metadata(backend, batch):
        if get_forward_context().mode == "target_verify":
            seen.append((batch.num_tokens, batch.input_ids.data_ptr(), batch.positions.data_ptr(),
                         batch.out_cache_loc.data_ptr(), batch.live))
        original(backend, batch)

    monkeypatch.setattr(AttentionBackend, "init_forward_metadata", init_forward_metadata)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    plain = engine(speculative_algorithm="none").generate(PROMPTS, params)
    e = engine()
    assert e.generate(PROMPTS, params) == plain
    e.scheduler.assert_idle_clean()
    runner, verify = e.runner, e.runner.verify_graphs
    assert runner.branch_counts["verify_replay"] == len(seen) > 10 and runner.branch_counts["eager_verify"] == 0
    assert verify.path_counts["verify_replay_padded"] > 0
    buffers = {b.out_cache_loc.numel(): (b.input_ids.data_ptr(), b.positions.data_ptr(), b.out_cache_loc.data_ptr())
               for b in verify.buffers.values()}
    for tokens, *ptrs, live in seen:
        assert tokens in buffers and tuple(ptrs) == buffers[tokens] and live is not None
    assert len({tokens for tokens, *_ in seen}) >= 2  # more than one (batch size, K) replayed


def verify_steps(e: Engine) -> PhaseOutput:
    """diagnose's `reserved_verify` phase: verify forwards through the runner over slots reserved ahead, back to
    back: 4 requests drafting K tokens each (exact), the same 4 with shorter and missing drafts (padded, same
    buffers), 1 request (padded), 5 requests (eager: more than the largest batch size, 4)."""
    return reserved_verify_phase(e, WORK, Driver(e, seed=0))


def test_replayed_logits_are_the_live_tokens_as_an_eager_verify_computes_them():
    replay, eager = engine(), engine(graphs=False)
    rows = []  # (tokens of each verify batch, logits rows the runner returned for it)
    forward = replay.runner.forward

    def counted(batch):
        logits = forward(batch)
        rows.append((batch.num_tokens, logits.shape[0]) if batch.verify else None)
        return logits

    replay.runner.forward = counted
    ours, theirs = verify_steps(replay), verify_steps(eager)
    assert [r for r in rows if r] == [(20, 20), (16, 16), (2, 2), (10, 10)]  # no padded row returned
    counts = replay.runner.branch_counts
    assert (counts["verify_replay"], counts["eager_verify"], eager.runner.branch_counts["eager_verify"]) == (3, 1, 4)
    paths = replay.runner.verify_graphs.path_counts
    assert (paths["verify_replay_exact"], paths["verify_replay_padded"]) == (1, 2)
    assert ours.tokens == theirs.tokens and len(ours.tokens) == 5
    for a, b, tokens in zip(ours.logits, theirs.logits, ours.tokens):
        assert len(a) == len(tokens) >= 2  # the prefill's token, then what each verify emitted
        # float32; the replay's matmuls run over the padded tail too, so the rounding may differ (1.1e-5 seen)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    assert bad_events(replay) == {} and bad_events(eager) == {}


@pytest.mark.parametrize("inject", [(), ("skip-forward-invalidation",)], ids=["clean", "skip-forward-invalidation"])
def test_every_verify_replay_invalidates_the_translation_cache_first(inject):
    """Back-to-back verify replays of one buffer with no allocation between them: only the forward entry
    stands between one replay's cached translation and the next's (same address, rewritten contents)."""
    e = engine(inject=inject, loc_cache="memo")
    entries = e.stats.translation.invalidation_counts
    before = entries["forward_entry"]
    verify_steps(e)
    replays = e.runner.branch_counts["verify_replay"]
    if not inject:
        assert entries["forward_entry"] - before == replays + 2 and bad_events(e) == {}  # + the eager ones
        return
    assert entries["forward_entry"] - before == 2  # the eager prefill and the eager verify alone
    stale = [x for x in e.reporter.first_events() if x.classification == "stale_loc"]
    assert stale and stale[0].mode == stale[0].prev_mode == "target_verify" and stale[0].key == stale[0].prev_key
