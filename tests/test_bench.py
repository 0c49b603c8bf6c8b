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
    assert len(o["pair_ratios"]) == o["steps_per_side"] and all(0 < r < 100 for r in o["pair_ratios"])  # ms steps: noisy
    assert o["overhead_pct"] == pytest.approx((statistics.median(o["pair_ratios"]) - 1) * 100)
    low, high = o["overhead_pct_ci95"]
    assert low <= o["overhead_pct"] <= high


def test_throughput_row_counts_disagreements_and_ratios():
    ours = RunResult([[1, 2], [3, 4]], seconds=1.0, decode_seconds=0.5)
    theirs = RunResult([[1, 2], [3, 5]], seconds=2.0, decode_seconds=1.0)
    row = throughput_row(2, 2, ours, theirs)
    assert row["equal_token_fraction"] == 0.75 and row["identical_sequences"] == 1
    assert (row["ours_tok_s"], row["hf_tok_s"], row["ratio"]) == (4.0, 2.0, 2.0)
    assert (row["ours_decode_tok_s"], row["hf_decode_tok_s"], row["decode_ratio"]) == (4.0, 2.0, 2.0)


class _ScriptedEngine:
    """Steps its requests with fixed decode-step times, so the overhead arithmetic and the order in which
    the two engines step can be checked."""

    def __init__(self, label, step_seconds, probe, calls):
        self.label, self.step_seconds, self.probe, self.calls = label, step_seconds, probe, calls
        self.scheduler, self.reqs = self, []

    def add(self, req):
        self.reqs.append(req)

    def step(self):
        live = [r for r in self.reqs if not r.done]
        self.calls.append(self.label)
        for r in live:
            r.output_ids.append(7)
            if len(r.output_ids) == r.params.max_new_tokens:
                r.status = "finished"
        if len(live[0].output_ids) > 1:  # the first token comes from prefill
            self.probe.decode_steps.append(self.step_seconds[len(self.probe.decode_steps)])
        return True


class _ScriptedProbe:
    def __init__(self, label, step_seconds, calls):
        self.engine = _ScriptedEngine(label, step_seconds, self, calls)
        self.reset()

    def reset(self):
        self.decode_steps = []


def test_telemetry_overhead_steps_both_engines_in_lockstep_and_pairs_their_steps():
    calls = []
    off = [0.010, 0.020, 0.010, 0.040]  # load drifts from step to step: both sides see it
    probes = {"on": _ScriptedProbe("on", [t * 1.01 for t in off], calls),
              "off": _ScriptedProbe("off", off, calls)}
    o = telemetry_overhead(probes, [[2, 5, 6]], gen_len=5, rounds=2, progress=False)
    # round 0: on/off, off/on, ...; round 1 starts off/on
    assert calls == ["on", "off", "off", "on"] * 2 + ["on", "off"] + ["off", "on", "on", "off"] * 2 + ["off", "on"]
    assert o["steps_per_side"] == 8 and o["pair_ratios"] == pytest.approx([1.01] * 8)
    assert o["overhead_pct"] == pytest.approx(1.0) and o["overhead_pct_ci95"] == pytest.approx((1.0, 1.0))
    assert (o["median_step_ms_on"], o["median_step_ms_off"]) == pytest.approx((15.15, 15.0))


def test_the_median_interval_covers_the_middle_order_statistics():
    from runtime.bench import median_interval

    assert median_interval([5.0]) == (5.0, 5.0)
    values = list(range(100))  # n = 100: k = int(50 - 9.8) = 40
    assert median_interval(values) == (40, 59)


def test_the_engine_options_reach_the_benched_model(tmp_path):
    """`--quantization int8` builds the shared model int8 (the engines refuse a model of another format)."""
    path = tmp_path / "bench.json"
    argv = ["bench", "--model", "tiny", "--quantization", "int8", "--prompt-len", "20", "--gen-len", "3",
            "--batch-sizes", "1", "--overhead-rounds", "1", "--skip-transformers", "--json", str(path)]
    assert main(argv) == 0
    report = json.loads(path.read_text())
    assert report["setup"]["quantization"] == "int8"
    assert report["throughput"][0]["generated_tokens"] == 3


def test_bench_serve_counts_every_streamed_token_on_each_side(tmp_path, capsys):
    """`bench --serve` against a real tiny server, with a second real server as the `--peer`: every level
    reports the requests x gen-len tokens the servers say they generated (EOS ignored), one TTFT per request
    and gaps between text chunks on both servers, and c=1 is paired with the offline engine."""
    from runtime.bench_serve import start_server, stop_server

    peer, peer_url = start_server(["--model", "tiny", "--max-queued-requests", "8"])
    try:
        path = tmp_path / "serve.json"
        argv = ["bench", "--serve", "--model", "tiny", "--prompt-len", "24", "--gen-len", "5",
                "--concurrency", "1,3", "--min-requests", "2", "--skip-transformers", "--stall-body-mb", "0.01",
                "--peer", peer_url, "--peer-model", "tiny", "--rounds", "2", "--json", str(path)]
        assert main(argv) == 0
    finally:
        stop_server(peer)
    report = json.loads(path.read_text())
    rows = {(w["system"], w["concurrency"]): w for w in report["waves"]}
    assert set(rows) == {("swa-runtime serve", 1), ("swa-runtime serve", 3), ("peer tiny", 1), ("peer tiny", 3),
                         ("offline engine", 1)}
    for (system, c), w in rows.items():
        requests = 2 * max(c, 2)  # two rounds
        assert w["tokens"] == requests * 5 and w["seconds"] > 0 and len(w["rounds"]) == 2
        if system != "offline engine":
            # byte-level tiny tokens: a chunk may hold back a partial character, and tokens that reach the front
            # end together (a loaded machine) go out in one chunk, so not one chunk per token (once, CI saw one
            # request's five tokens in a single chunk)
            assert len(w["ttft"]) == requests and 1 <= len(w["itl"]) <= requests * 4 + requests
    out = capsys.readouterr().out
    assert "the server at c=1 vs the offline engine" in out and "failed" not in out
    ours, peer = ({c: rows[(system, c)] for c in (1, 3)} for system in ("swa-runtime serve", "peer tiny"))
    ratios = {c: ours[c]["tok_s"] / peer[c]["tok_s"] for c in (1, 3)}
    spread = {c: sorted(a / b for a, b in zip(ours[c]["rounds"], peer[c]["rounds"])) for c in (1, 3)}
    assert (f"swa-runtime serve vs peer tiny: {ratios[1]:.2f}x at c=1 (rounds {spread[1][0]:.2f}-{spread[1][1]:.2f}), "
            f"{ratios[3]:.2f}x at c=3 (rounds {spread[3][0]:.2f}-{spread[3][1]:.2f}) (tok/s)") in out
    stall = report["stall"]  # the intruder's prompt outgrows the tiny model's context: refused, not parsed
    assert stall["body_status"] == 400 and stall["max_gap_ms"] >= stall["median_gap_ms"] > 0


def test_servers_take_turns_and_each_round_is_kept():
    """Round r starts at the r-th side (wrapping); a side's waves add up into one, each round's tok/s kept; a
    failed round counts nothing."""
    from runtime.bench_serve import Wave, take_turns

    calls = []

    def side(system: str, tokens: int, fail_in: int | None = None):
        def run(r: int):
            calls.append((system, r))
            return None if r == fail_in else Wave(system, 8, seconds=2.0, tokens=tokens, ttft=[0.1])
        return run

    level = take_turns([side("a", 10), side("b", 20), side("c", 40, fail_in=1)], 3)
    assert calls == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1), ("c", 2), ("a", 2), ("b", 2)]
    a = level["a"]
    assert (a.tokens, a.seconds, a.rounds, a.ttft) == (30, 6.0, [5.0] * 3, [0.1] * 3)
    assert (level["c"].tokens, level["c"].rounds) == (80, [20.0, 20.0])


def test_each_round_sends_prompts_of_its_own():
    """A prompt sent again would be answered from a prefix cache: each round gets its own, all different."""
    from argparse import Namespace

    from runtime.bench_serve import _workload, round_prompts
    from runtime.config import EngineConfig

    args = Namespace(workload="standard", min_requests=3, prompt_len=24)
    prompts = _workload(args, EngineConfig(model="tiny"), [1, 4], rounds=3).prompts
    for c, n in ((1, 3), (4, 4)):
        shares = [round_prompts(prompts[c], 3, r) for r in range(3)]
        assert [len(s) for s in shares] == [n] * 3
        assert len({tuple(p) for s in shares for p in s}) == 3 * n


def test_rounds_below_one_and_rounds_with_compare_speculation_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--serve", "--rounds", "0"])
    assert exit_.value.code == 2 and "--rounds: wants a whole number of at least 1, got '0'" in capsys.readouterr().err
    assert main(["bench", "--serve", "--compare-speculation", "--rounds", "2", "--model", "tiny"]) != 0
    assert "--rounds does not apply" in capsys.readouterr().err


def test_a_ratio_gives_the_rounds_range_only_where_every_round_pairs():
    from runtime.bench_serve import Wave, _peer_ratio

    ours = Wave("swa-runtime serve", 8, seconds=4.0, tokens=120, rounds=[20.0, 40.0])
    peer = Wave("peer x", 8, seconds=4.0, tokens=60, rounds=[20.0, 10.0])
    assert _peer_ratio(ours, peer) == "2.00x at c=8 (rounds 1.00-4.00)"
    assert _peer_ratio(ours, Wave("peer x", 8, seconds=2.0, tokens=30, rounds=[15.0])) == "2.00x at c=8"
    assert _peer_ratio(Wave("s", 8, 1.0, 10, rounds=[10.0]), Wave("p", 8, 1.0, 5, rounds=[5.0])) == "2.00x at c=8"


def test_chunks_without_a_token_are_not_timed():
    from runtime.bench_serve import _closing_chunk

    assert _closing_chunk({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})  # llama.cpp's last
    assert _closing_chunk({"choices": [], "usage": {"completion_tokens": 5}})  # a usage-only chunk
    assert not _closing_chunk({"choices": [{"text": "a", "finish_reason": "length"}]})  # last token + reason
    assert not _closing_chunk({"choices": [{"text": "", "finish_reason": None}]})  # a held-back token


def test_the_memory_limit_is_the_bytes_read_over_the_measured_bandwidth(tiny_report):
    """float32 tiny model, tied head: one step reads every parameter once (the table as the head), one
    embedding row per token and its keys and values; the floor is those bytes over the bandwidth probed after
    each round, each round's median step held against its own floor, the ratio the median over rounds."""
    import statistics

    import torch

    from runtime.models.loader import build_model, random_state_dict

    config = Gemma3Config.tiny()
    model = build_model(config, random_state_dict(config, seed=0), torch.float32)
    m = tiny_report["memory_limit"]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert config.tie_word_embeddings and m["batch"] == 1
    assert m["weight_bytes"] == params + m["batch"] * config.hidden_size * 4
    # decode step i (1..GEN_LEN-1) attends PROMPT_LEN + i keys: all of them on a full layer, at most the window
    # on a sliding one; a key and its value are 2 * kv_heads * head_dim float32 values a layer
    row = 2 * config.num_key_value_heads * config.head_dim * 4
    per_step = [row * (len(config.full_layer_ids) * (PROMPT_LEN + i)
                       + len(config.sliding_layer_ids) * min(PROMPT_LEN + i, config.sliding_window))
                for i in range(1, GEN_LEN)]
    assert m["kv_bytes"] == pytest.approx(sum(per_step) / len(per_step)) and m["kv_bytes"] > 0
    assert m["read_bytes"] == pytest.approx(m["weight_bytes"] + m["kv_bytes"])
    rounds = tiny_report["telemetry_overhead"]["per_round"]
    assert len(rounds) == tiny_report["telemetry_overhead"]["rounds"] and all(bw > 1e8 for _, bw in rounds)
    assert m["read_bandwidth"] == pytest.approx(statistics.median(bw for _, bw in rounds))
    assert m["read_bandwidth_range"] == [min(bw for _, bw in rounds), max(bw for _, bw in rounds)]  # JSON: a list
    assert m["floor_ms"] == pytest.approx(m["read_bytes"] / m["read_bandwidth"] * 1e3)
    assert m["round_ratios"] == pytest.approx([step / (m["read_bytes"] / bw) for step, bw in rounds])
    assert m["step_over_floor"] == pytest.approx(statistics.median(m["round_ratios"]))
    assert m["step_ms"] == pytest.approx(tiny_report["telemetry_overhead"]["median_step_ms_on"])


@pytest.mark.parametrize("quantization", ["int8-head", "int8"])
def test_decode_bytes_count_the_copy_each_layer_multiplies_with(quantization):
    import torch

    from runtime.layers.quantized import DYNAMIC_MAX_ROWS
    from runtime.memory_bound import decode_weight_bytes
    from runtime.models.loader import build_model, random_state_dict

    config = Gemma3Config.tiny()
    model = build_model(config, random_state_dict(config, seed=0), torch.bfloat16, quantization=quantization)
    V, D = config.vocab_size, config.hidden_size
    if quantization == "int8-head":
        if model.model.embed_tokens.int8 is None:
            pytest.skip("this torch has no quantized-tensor API: the float head serves every row")
        floats = sum(p.numel() * 2 for p in model.parameters())  # all bfloat16, the table among them
        copies = [m for m in model.modules() if getattr(m, "decode", None) is not None]  # projections' copies

        def saved(rows: int) -> int:
            return sum(m.weight.numel() * 2 - m.decode.nbytes() for m in copies if rows <= m.decode.max_rows)

        assert saved(1) > 0
        for rows in (1, DYNAMIC_MAX_ROWS):  # the int8 copy (int8 weights, float32 scales) replaces the table
            assert decode_weight_bytes(model, rows) == floats - saved(rows) - V * D * 2 + rows * D * 2 + V * D + V * 4
        more = DYNAMIC_MAX_ROWS + 1  # the float head; the projections' copies where they take that many rows
        assert decode_weight_bytes(model, more) == floats - saved(more) + more * D * 2
    else:
        int8 = [m for m in model.modules() if hasattr(m, "weight_int8")]
        int8_bytes = sum(m.weight_int8.numel() + m.scales.numel() * 4 for m in int8)
        norms = sum(p.numel() * p.element_size() for p in model.parameters())  # the int8 layers hold buffers
        assert decode_weight_bytes(model, 3) == int8_bytes + norms + 3 * D  # int8 lookups: one byte a value


def test_peers_pair_with_their_model_names_in_order():
    from argparse import Namespace

    from runtime.bench_serve import peers

    assert peers(Namespace(peer=None, peer_model=None)) == []
    assert peers(Namespace(peer=["http://a", "http://b"], peer_model=["llama.cpp"])) == [
        ("http://a", "llama.cpp"), ("http://b", "default")]
    with pytest.raises(ValueError, match="one --peer URL per model"):
        peers(Namespace(peer=["http://a"], peer_model=["x", "y"]))
