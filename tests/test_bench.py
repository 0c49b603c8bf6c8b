"""`swa-runtime bench` on the tiny model: the numbers it reports are the ones computed independently here."""

import json
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may reach a model hub; set before transformers loads

import pytest

from runtime.bench import RunResult, telemetry_overhead, throughput_row
from runtime.cli import main
from runtime.models.config import Gemma3Config

PROMPT_LEN, GEN_LEN, ROUNDS = 40, 8, 2


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    argv = ["bench", "--model", "tiny", "--prompt-len", str(PROMPT_LEN), "--gen-len", str(GEN_LEN),
            "--batch-sizes", "1,2", "--overhead-rounds", str(ROUNDS), "--json", str(path)]
    assert main(argv) == 0
    return json.loads(path.read_text())


def test_greedy_outputs_equal_transformers_on_the_same_weights(tiny_report):
    rows = tiny_report["throughput"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["generated_tokens"] == r["batch"] * GEN_LEN and r["ours_recomputed_tokens"] == 0
        assert r["equal_token_fraction"] == 1.0 and r["identical_sequences"] == r["batch"]
        assert r["ours_tok_s"] > 0 and r["hf_tok_s"] > 0
        assert r["ratio"] == pytest.approx(r["ours_tok_s"] / r["hf_tok_s"])


def test_kv_bytes_per_token_match_the_window_arithmetic(tiny_report):
    config = Gemma3Config.tiny()
    # At the end of prefill a request keeps every token in the full pool, and in the SWA pool only the
    # window - 1 tokens that the next query can still see.
    kept = min(PROMPT_LEN, config.sliding_window - 1)
    full_layers, sliding_layers = len(config.full_layer_ids), len(config.sliding_layer_ids)
    per_layer = 2 * config.num_key_value_heads * config.head_dim * 4  # K and V, float32
    for r in tiny_report["kv"]:
        assert (r["tokens"], r["full_slots"], r["swa_slots"]) == (
            r["batch"] * PROMPT_LEN, r["batch"] * PROMPT_LEN, r["batch"] * kept)
        assert r["full_attention_bytes_per_token"] == config.num_hidden_layers * per_layer
        expected = (full_layers * PROMPT_LEN + sliding_layers * kept) * per_layer / PROMPT_LEN
        assert r["ours_bytes_per_token"] == pytest.approx(expected)
        assert r["ratio"] == pytest.approx((2 * 40 + 4 * 7) / (6 * 40))  # 0.45 for the S S F S S F layout


def test_telemetry_overhead_times_every_decode_step_of_both_sides(tiny_report):
    o = tiny_report["telemetry_overhead"]
    assert o["steps_per_side"] == ROUNDS * (GEN_LEN - 1)  # batch 1: one decode forward per new token but the first
    assert o["median_step_ms_on"] > 0 and o["median_step_ms_off"] > 0
    assert len(o["pair_ratios"]) == ROUNDS and all(0.2 < r < 5 for r in o["pair_ratios"])
    assert o["overhead_pct"] == pytest.approx((statistics.median(o["pair_ratios"]) - 1) * 100)


def test_throughput_row_counts_disagreements_and_ratios():
    ours = RunResult([[1, 2], [3, 4]], seconds=1.0, decode_seconds=0.5)
    theirs = RunResult([[1, 2], [3, 5]], seconds=2.0, decode_seconds=1.0)
    row = throughput_row(2, 2, ours, theirs)
    assert row["equal_token_fraction"] == 0.75 and row["identical_sequences"] == 1
    assert (row["ours_tok_s"], row["hf_tok_s"], row["ratio"]) == (4.0, 2.0, 2.0)
    assert (row["ours_decode_tok_s"], row["hf_decode_tok_s"], row["decode_ratio"]) == (4.0, 2.0, 2.0)


class _ScriptedEngine:
    """Reports fixed decode-step times, so the overhead arithmetic and the run order can be checked."""

    def __init__(self, label, step_seconds, probe, calls):
        self.label, self.step_seconds, self.probe, self.calls = label, step_seconds, probe, calls

    def generate(self, prompts, params):
        self.calls.append(self.label)
        self.probe.decode_steps += [self.step_seconds] * (params.max_new_tokens - 1)


class _ScriptedProbe:
    def __init__(self, label, step_seconds, calls):
        self.engine = _ScriptedEngine(label, step_seconds, self, calls)
        self.reset()

    def reset(self):
        self.decode_steps = []


def test_telemetry_overhead_runs_pairs_in_abba_order_and_reports_the_on_off_ratio():
    calls = []
    probes = {"on": _ScriptedProbe("on", 0.011, calls), "off": _ScriptedProbe("off", 0.010, calls)}
    o = telemetry_overhead(probes, [[2, 5, 6]], gen_len=5, rounds=3, progress=False)
    assert calls == ["on", "off", "off", "on", "on", "off"]
    assert o["steps_per_side"] == 12 and o["pair_ratios"] == pytest.approx([1.1] * 3)
    assert o["overhead_pct"] == pytest.approx(10.0)
    assert (o["median_step_ms_on"], o["median_step_ms_off"]) == pytest.approx((11.0, 10.0))


def test_the_engine_options_reach_the_benched_model(tmp_path):
    """`--quantization int8` builds the shared model int8 (the engines refuse a model of another format)."""
    path = tmp_path / "bench.json"
    argv = ["bench", "--model", "tiny", "--quantization", "int8", "--prompt-len", "20", "--gen-len", "3",
            "--batch-sizes", "1", "--overhead-rounds", "1", "--skip-transformers", "--json", str(path)]
    assert main(argv) == 0
    report = json.loads(path.read_text())
    assert report["setup"]["quantization"] == "int8"
    assert report["throughput"][0]["generated_tokens"] == 3
