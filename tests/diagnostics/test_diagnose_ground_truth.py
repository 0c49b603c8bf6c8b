"""diagnose's ground truth and coverage: corruption that no detector sees is its own failing row, a bug that
corrupts every policy alike (the uncached `off` run included) is caught, and a memory path the workload never
takes fails the run."""

import json

import pytest

from runtime.attention.base import AttentionBackend
from runtime.cli import main
from runtime.diagnose import SETUPS, run_diagnose
from runtime.diagnose.reference import DenseReference
from runtime.diagnose.workload import compare
from runtime.engine import Engine
from runtime.executor.graph_runner import StaticGraphRunner
from runtime.mem_cache import paths
from runtime.models.loader import load_model
from runtime.scheduler.scheduler import Scheduler


def raw_kernel_kv_scribble(mp):
    """After every step, a raw kernel (written through numpy: no version counter moves) nudges the SWA-pool
    keys of each running request's newest token: KV corrupted between forwards through a path nothing counts."""
    original = Scheduler.process

    def process(self, batch, tokens):
        original(self, batch, tokens)
        mapping, pool = self.slots.allocator.full_to_swa_index_mapping, self.slots.host.pool.swa_pool
        for r in self.running:
            swa = int(mapping[r.locs[-1]]) if r.locs else 0
            if swa > 0:
                for buf in pool.k_buffers:
                    buf.numpy()[swa] += 0.5

    mp.setattr(Scheduler, "process", process)


def first_head_scaled_in_paged_attention(mp):
    """The paged attention of layer 0 returns its first head's output scaled by 1.5 (a wrong per-head constant
    in a kernel; the whole output scaled would vanish in the post-attention RMSNorm): every policy, `off`
    included, computes the same wrong numbers, and no location is ever wrong."""
    original = AttentionBackend.forward

    def forward(self, q, k, v, layer):
        out = original(self, q, k, v, layer)
        if layer.layer_id != 0:
            return out
        heads = out.reshape(out.shape[0], layer.num_heads, -1).clone()  # (T, H, D)
        heads[:, 0] *= 1.5
        return heads.reshape(out.shape)

    mp.setattr(AttentionBackend, "forward", forward)


def test_corruption_no_detector_sees_is_an_undetected_corruption_row(monkeypatch):
    raw_kernel_kv_scribble(monkeypatch)
    report = run_diagnose(policies=("memo",))
    assert report.exit_status == 1
    assert [r for r in report.rows if not r.benign] == []  # no event: the detectors missed it
    [memo] = report.policies
    assert memo.undetected and memo.undetected == memo.mismatches
    # the engine-loop phases are hit (the scribble runs after each scheduler step), the direct ones are not
    assert {m.phase for m in memo.undetected} == {"scheduler", "prefix_cache", "prefix_edits"}
    assert all(m.max_logit_diff > 1e-3 for m in memo.undetected)
    assert sum(m.tokens_differ for m in memo.undetected) > 0
    undetected = [f for f in report.failures if "undetected corruption" in f]
    assert len(undetected) == len(memo.undetected)
    assert undetected[0].startswith("memo: undetected corruption (no bug-class event): outputs differ from the "
                                    "dense reference: scheduler: ")
    assert report.totals()["undetected_corruption"] == len(memo.undetected)


def test_undetected_corruption_in_the_table_and_the_json(monkeypatch, capsys):
    raw_kernel_kv_scribble(monkeypatch)
    assert main(["diagnose", "--policy", "memo"]) == 1
    text = capsys.readouterr().out
    lines = text.splitlines()
    i = lines.index("undetected corruption: outputs the dense reference contradicts, no bug-class event in the phase")
    assert lines[i + 1].split() == ["policy", "setup", "phase", "tokens", "differ", "max", "|dlogit|"]
    assert lines[i + 2].split()[:3] == ["memo", "base", "scheduler"]
    assert "outputs memo        DIFFER vs the dense reference" in text
    assert main(["diagnose", "--policy", "memo", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    rows = report["undetected_corruption"]
    assert rows and report["totals"]["undetected_corruption"] == len(rows)
    assert {(r["policy"], r["setup"], r["phase"]) for r in rows} >= {("memo", "base", "scheduler")}
    for r in rows:
        assert r["undetected"] and r["max_logit_diff"] > 1e-3 and 0 <= r["tokens_differ"] <= r["tokens_total"]
    assert report["runs"][0]["outputs_equal"] is False and report["exit_status"] == 1


def test_a_bug_that_corrupts_every_policy_alike_is_caught(monkeypatch):
    first_head_scaled_in_paged_attention(monkeypatch)
    report = run_diagnose(policies=("memo", "off"))
    memo, off = report.policies
    # what diagnose compared before: each policy against the `off` run of the same build -- equal
    for mine, theirs in zip(memo.runs, off.runs):
        assert compare(mine, theirs) == []
    # against the dense reference, both differ in every phase of every setup, and nothing counted an event
    for p in (memo, off):
        assert {(m.setup, m.phase) for m in p.mismatches} == {(s.name, ph) for s in SETUPS for ph in s.phases}
        assert all(m.undetected for m in p.mismatches)
    assert report.exit_status == 1 and [r for r in report.rows if not r.benign] == []


def padding_aimed_at_a_live_slot(mp):
    """Graph replay (decode and verify) pads a short batch with tokens that write into the first request's new
    slot instead of the sink (issue 21, class 1: padded rows of the static buffers not reset)."""
    original = StaticGraphRunner.load

    def load(self, batch):
        static = original(self, batch)
        static.out_cache_loc[batch.num_tokens:] = batch.out_cache_loc[0]
        return static

    mp.setattr(StaticGraphRunner, "load", load)


def test_padding_that_writes_a_live_slot_is_caught_under_every_policy(monkeypatch):
    padding_aimed_at_a_live_slot(monkeypatch)
    wide = tuple(s for s in SETUPS if s.name == "wide")  # the setup whose batches are replayed padded
    report = run_diagnose(policies=("memo", "off"), setups=wide)
    for p in report.policies:  # before: memo compared equal to off, which writes the same wrong slot
        assert {(m.setup, m.phase) for m in p.mismatches} == {("wide", "reserved_verify"), ("wide", "wide_decode")}
        assert all(m.max_logit_diff > 0.1 for m in p.mismatches)
    assert report.exit_status == 1


def test_the_reference_rules_out_tokens_only_beyond_rounding():
    _, net = load_model("tiny", progress=False)
    dense = DenseReference(net)
    prompt, tokens = list(range(10, 30)), []
    for _ in range(3):  # greedy, through the reference itself
        tokens.append(int(dense.logits(prompt + tokens)[-1].argmax()))
    ref = dense.logits(prompt + tokens[:-1])[len(prompt) - 1:]  # (3, vocab): what each token was sampled from
    assert dense.check(prompt, tokens, ref.clone()).tokens_differ == 0
    # a rounding-sized difference is within tolerance; a corrupted row is not, and its token is ruled out
    nudged = ref + 1e-6
    assert (dense.check(prompt, tokens, nudged).tokens_differ, dense.check(prompt, tokens, nudged).max_logit_diff) \
        == (0, 0.0)
    wrong = ref.clone()
    worst = int(ref[2].argmin())
    wrong[2, worst] = ref[2].max() + 1.0  # the last token: the reference's least likely one was sampled
    result = dense.check(prompt, [tokens[0], tokens[1], worst], wrong)
    assert result.tokens_differ == 1 and result.max_logit_diff == pytest.approx(
        float(ref[2].max() + 1.0 - ref[2, worst]), rel=1e-5)


# ---- coverage of memory paths ----------------------------------------------------------------------------------
def test_every_component_counts_exactly_the_declared_paths():
    from runtime.diagnose.coverage import memory_path_counts
    from runtime.diagnose.workload import Workload

    _, net = load_model("tiny", progress=False)
    work = Workload(window=net.config.sliding_window, vocab=net.config.vocab_size)
    engine = Engine(work.engine_config("tiny", "memo"), progress=False, model=net)
    alloc = engine.pool.allocator
    declared = [*alloc.full.path_counts, *alloc.path_counts, *engine.scheduler.path_counts,
                *engine.slots.tree.path_counts, *engine.runner.graphs.path_counts,
                *engine.runner.verify_graphs.path_counts]
    assert sorted(declared) == sorted(paths.MEMORY_PATHS) and len(set(declared)) == len(declared)
    assert set(memory_path_counts(engine)) == set(paths.MEMORY_PATHS)
    with pytest.raises(KeyError):  # a path counted without being declared cannot slip through
        alloc.path_counts["alloc_somewhere_new"] += 1


def test_a_memory_path_never_taken_fails_diagnose(monkeypatch):
    monkeypatch.setattr(paths, "MEMORY_PATHS", (*paths.MEMORY_PATHS, "evict_to_disk"))
    report = run_diagnose(policies=("memo",), setups=SETUPS[:1])
    assert "memo: the workload did not take memory path evict_to_disk" in report.failures


def test_removing_a_setup_fails_the_paths_only_it_takes():
    dropped = {"wide", "small_host"}
    report = run_diagnose(policies=("memo",), setups=tuple(s for s in SETUPS if s.name not in dropped))
    missing = sorted(f.rsplit(" ", 1)[1] for f in report.failures if "did not take memory path" in f)
    assert missing == ["decode_twice_graph_max", "graph_replay_padded", "host_drop", "verify_replay_exact"]
    assert report.exit_status == 1
