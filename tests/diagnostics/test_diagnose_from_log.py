"""`swa-runtime diagnose --from-log`: the table rebuilt from the structured logs of real `diagnose` runs, with
junk mixed in, equals the runs' own reports (rows, counts, first occurrences, exit status); several replicas'
logs are attributed per instance; every unusable line is counted by kind; no input makes it crash."""

import gzip
import io
import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.cli import main
from runtime.diagnose.from_log import SUMMARY_EVENT, InputSummary, LogReader, instance_names
from runtime.diagnose.log_lines import MAX_LINE_BYTES

ROOT = Path(__file__).resolve().parents[2]
FIRST = ("forward_id", "mode", "prev_site", "prev_forward_id", "prev_mode", "cause", "stack")

# One real run per log, each a few seconds on the tiny model: (diagnose arguments, log level).
RUNS = {
    # every bug row has count 1: the log carries every event
    "alloc": (["--inject", "skip-alloc-invalidation", "--policy", "memo", "--policy", "layerwise"], "warning"),
    # stale_loc repeats after its only record: the log cannot carry them
    "forward": (["--inject", "skip-forward-invalidation", "--policy", "memo"], "warning"),
    # a clean build at debug level: benign rows only, exit 0 (the reference is `off`, which logs nothing)
    "clean": (["--policy", "memo"], "debug"),
    # benign rows filled by the one-off site: exit 1 through the one-off check, not through a bug row
    "window": (["--inject", "window-buffer-pollution", "--policy", "memo"], "debug"),
}


class Logged:
    def __init__(self, rc: int, report: dict, log: bytes):
        self.rc, self.report, self.log = rc, report, log
        self.lines = [line for line in log.splitlines() if line.strip()]


_LOGGED: dict[str, Logged] = {}


@pytest.fixture(scope="module")
def logged():
    """`logged(name)`: the exit status, `--json` report and JSON log of the real run RUNS[name], run once."""

    def get(name: str) -> Logged:
        if name not in _LOGGED:
            args, level = RUNS[name]
            cmd = [sys.executable, "-m", "runtime", "diagnose", "--json", "--log-format", "json", "--log-level",
                   level, *args]
            proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                                  timeout=600)
            assert proc.returncode in (0, 1), proc.stderr.decode(errors="replace")[-2000:]
            _LOGGED[name] = Logged(proc.returncode, json.loads(proc.stdout), proc.stderr)
        return _LOGGED[name]

    return get


def from_log(capsys, *paths, text: bool = False):
    """Run `diagnose --from-log` in-process; (exit status, JSON report or text)."""
    rc = main(["diagnose", "--from-log", *map(str, paths), *([] if text else ["--json"])])
    out = capsys.readouterr().out
    return rc, (out if text else json.loads(out))


def table(rows: list[dict], benign: bool = True) -> dict:
    """(policy, site, classification) -> (count, first occurrence, fix) for the rows asked for."""
    return {(r["policy"], r["site"], r["classification"]): (r["count"], tuple(r["first"][k] for k in FIRST), r["fix"])
            for r in rows if benign or not r["benign"]}


def per_instance(report: dict) -> dict:
    out: dict = {}
    for r in report["rows"]:
        out.setdefault(r["instance"], []).append(r)
    return {name: table(rows) for name, rows in out.items()}


# ---- a real log, with junk mixed in --------------------------------------------------------------------------
def cut(line: bytes) -> bytes:
    return line[: len(line) // 2]


def junk(record: bytes) -> list[tuple[bytes, str]]:
    """Lines that are no key-change record, each with the kind the report must count it under."""
    return [
        (b"", "blank"),
        (b"  \t", "blank"),
        (b"Traceback (most recent call last):", "not_json"),
        (b"2026-11-23 06:24:12 [warning  ] loc_key_change  site=kv_write classification=stale_loc", "not_json"),
        (b'{"level": "info", "msg": "GET /health 200", "service": "nginx"}', "other_json"),
        (b'{"event": "request_finished", "level": "info", "request_id": "r-17"}', "other_json"),
        (b"[1, 2, 3]", "other_json"),
        (b"\xff\xfe\x00 binary \x80\xc3(", "not_json"),
        (cut(record), "truncated"),
        (b'{"event": "loc_key_change", "site": 7, "classification": "stale_loc", "policy": "memo"}',
         "malformed_event"),
        (b'{"event": "loc_key_change", "site": "kv_write", "classification": "stale_loc", "policy": "memo", '
         b'"suppressed_since_last": -3}', "malformed_event"),
        (b"x" * (MAX_LINE_BYTES + 10), "too_long"),
        (b"[" * 100_000, "not_json"),
        (b'{"a": ' * 50_000, "not_json"),  # nested deeper than the parser goes
        (b'{"event": "loc_key_change", "forward_id": ' + b"9" * 5000 + b"}", "not_json"),
    ]


def mixed(lines: list[bytes]) -> tuple[bytes, Counter]:
    """The log's lines with junk between them, CRLF endings on some, and a record cut short by a writer that
    died, glued to the next real record; and the unusable kinds the report must count."""
    extra = junk(lines[0])
    out, expected = [], Counter(kind for _, kind in extra)
    for i in range(max(len(lines), len(extra))):
        if i < len(extra):
            out.append(extra[i][0])
        if i < len(lines):
            out.append(lines[i] + (b"\r" if i % 2 else b""))
    out.insert(len(out) // 2, cut(lines[-1]) + lines[-1])  # the last record again, after a cut copy of itself
    expected["truncated"] += 1
    return b"\n".join(out) + b"\n", expected


def test_junk_mixed_into_a_real_log_gives_the_runs_own_rows(logged, capsys, tmp_path):
    run = logged("alloc")
    assert [r["suppressed_logs"] for r in run.report["runs"]] == [0, 0]  # so the log has every event
    data, expected = mixed(run.lines)
    # the glued copy repeats the last record: its row counts one more than the run
    want = table(run.report["rows"], benign=False)
    last = json.loads(run.lines[-1])
    key = (last["policy"], last["site"], last["classification"])
    want[key] = (want[key][0] + 1, *want[key][1:])
    # rotated pieces given newest first, the older one compressed
    middle = data.index(b"\n", len(data) // 2) + 1
    (tmp_path / "server.log.1.gz").write_bytes(gzip.compress(data[:middle]))
    (tmp_path / "server.log").write_bytes(data[middle:])

    rc, report = from_log(capsys, tmp_path / "server.log", tmp_path / "server.log.1.gz")
    assert rc == run.rc == 1
    assert report["instances"] == ["server.log"]
    assert table(report["rows"]) == want and len(want) == 2
    assert report["lines"]["unused"] == {k: v for k, v in expected.items()}
    assert report["lines"]["records"] == len(run.lines) + 1
    assert report["lines"]["read"] == data.count(b"\n")
    assert any("mention a loc_key_change record" in n for n in report["notes"])  # the console line, the bad ones


def test_same_rows_and_exit_status_as_the_run_for_each_log(logged, capsys, tmp_path):
    for name in ("alloc", "clean"):
        run = logged(name)
        (tmp_path / f"{name}.log").write_bytes(run.log)
        rc, report = from_log(capsys, tmp_path / f"{name}.log")
        assert rc == run.rc == run.report["exit_status"]
        # the log has what its level lets through: bug rows at WARNING, all rows at DEBUG
        assert table(report["rows"]) == table(run.report["rows"], benign=RUNS[name][1] == "debug")
        assert set(report["lines"]["unused"]) <= {"other_json"}
        assert report["totals"]["failures"] == len(run.report["failures"])


def test_the_shutdown_summaries_make_the_counts_read_back_equal_the_run_s(logged, capsys, tmp_path):
    run = logged("forward")
    [policy] = run.report["runs"]
    assert policy["suppressed_logs"] > 0  # the rate limiter held some back
    assert any(json.loads(line).get("event") == SUMMARY_EVENT for line in run.lines)  # ... and said so at the end
    (tmp_path / "replica.log").write_bytes(run.log)
    rc, report = from_log(capsys, tmp_path / "replica.log")
    assert rc == run.rc == 1
    got, want = table(report["rows"]), table(run.report["rows"], benign=False)
    assert got == want  # counts included: every held-back repeat reached the log
    assert not any("lower bounds" in n for n in report["notes"])


def test_a_summary_of_suppressed_repeats_adds_its_count(logged, capsys, tmp_path):
    run = logged("forward")
    records = [json.loads(line) for line in run.lines]
    first = next(r for r in records if r.get("event") != SUMMARY_EVENT)
    summary = {**first, "event": SUMMARY_EVENT, "suppressed_since_last": 5}
    (tmp_path / "replica.log").write_bytes(run.log + json.dumps(summary).encode() + b"\n")
    rc, report = from_log(capsys, tmp_path / "replica.log")
    key = (first["policy"], first["site"], first["classification"])
    assert table(report["rows"])[key][0] == table(run.report["rows"], benign=False)[key][0] + 5


def test_first_occurrence_is_the_earliest_record_and_the_one_off_check_fails_as_in_the_run(logged, capsys,
                                                                                             tmp_path):
    run = logged("window")
    assert run.report["exit_status"] == 1 and not any(not r["benign"] for r in run.report["rows"])
    (tmp_path / "w.log").write_bytes(b"\n".join(reversed(run.lines)) + b"\n")  # newest first
    rc, report = from_log(capsys, tmp_path / "w.log")
    assert rc == run.rc == 1
    assert any("one-off `window_indices`" in f for f in report["failures"])
    # benign events are never rate-limited, and the reference run (`off`) logs none: every count is exact
    assert table(report["rows"]) == table(run.report["rows"])
    assert sum(r["count"] for r in report["rows"]) == len(run.lines) > 2


# ---- several replicas ----------------------------------------------------------------------------------------
def test_two_replicas_rows_go_to_their_own_instance(logged, capsys, tmp_path):
    clean, faulty = logged("clean"), logged("alloc")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "server.log").write_bytes(clean.log)
    (tmp_path / "b" / "server.log").write_bytes(faulty.log)
    rc, report = from_log(capsys, tmp_path / "a" / "server.log", tmp_path / "b" / "server.log")
    assert rc == 1 and report["instances"] == ["a/server.log", "b/server.log"]
    assert per_instance(report) == {"a/server.log": table(clean.report["rows"]),
                                    "b/server.log": table(faulty.report["rows"], benign=False)}
    assert report["failures"] and all(f.startswith("b/server.log ") for f in report["failures"])

    rc, text = from_log(capsys, tmp_path / "a" / "server.log", tmp_path / "b" / "server.log", text=True)
    rows = [line.split() for line in text.splitlines() if line.startswith(("a/server.log ", "b/server.log "))]
    assert any(line.split()[:2] == ["instance", "policy"] for line in text.splitlines())
    assert sorted((r[0], r[3], r[4]) for r in rows) == sorted(
        [("a/server.log", c, "benign") for _, _, c in table(clean.report["rows"])]
        + [("b/server.log", c, "BUG") for _, _, c in table(faulty.report["rows"], benign=False)])


def with_instance(lines: list[bytes], name: str) -> list[bytes]:
    return [json.dumps({**json.loads(line), "instance": name}).encode() for line in lines]


def test_instance_field_attributes_records_of_one_interleaved_stream(logged, capsys, monkeypatch):
    clean, faulty = logged("clean"), logged("alloc")
    a, b = with_instance(clean.lines, "10.0.0.1:30000"), with_instance(faulty.lines, "10.0.0.2:30000")
    idle = b'{"event": "engine_started", "level": "info", "instance": "10.0.0.3:30000"}'
    stream = [x for pair in zip(a, b) for x in pair] + a[len(b):] + b[len(a):] + [idle, b"garbage"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\n".join(stream))))
    rc, report = from_log(capsys, "-")
    assert rc == 1 and report["instances"] == ["10.0.0.1:30000", "10.0.0.2:30000", "10.0.0.3:30000"]
    assert per_instance(report) == {"10.0.0.1:30000": table(clean.report["rows"]),
                                    "10.0.0.2:30000": table(faulty.report["rows"], benign=False)}
    assert report["inputs"][0]["input"] == "stdin" and report["lines"]["unused"] == {"not_json": 1, "other_json": 1}


def test_compose_log_prefixes_name_the_replicas(logged, capsys, tmp_path):
    clean, faulty = logged("clean"), logged("alloc")
    lines = [b"runtime-1  | " + x for x in clean.lines] + [b"runtime-2  | " + x for x in faulty.lines]
    (tmp_path / "compose.log").write_bytes(b"\n".join(lines) + b"\nruntime-3  | starting\n")
    rc, report = from_log(capsys, tmp_path / "compose.log")
    assert per_instance(report) == {"runtime-1": table(clean.report["rows"]),
                                    "runtime-2": table(faulty.report["rows"], benign=False)}


def test_instance_names_from_files():
    names = instance_names(["/logs/a/server.log", "/logs/b/server.log", "/logs/b/server.log.1",
                            "/logs/b/server.log-20250101.gz", "/x/replica-1.jsonl", "/x/r.2"])
    assert names == {"/logs/a/server.log": "a/server.log", "/logs/b/server.log": "b/server.log",
                     "/logs/b/server.log.1": "b/server.log", "/logs/b/server.log-20250101.gz": "b/server.log",
                     "/x/replica-1.jsonl": "replica-1.jsonl", "/x/r.2": "r.2"}


# ---- the command line ----------------------------------------------------------------------------------------
def test_cli_errors_and_stdin_through_the_module_entry_point(logged, capsys, tmp_path):
    assert main(["diagnose", "--from-log", str(tmp_path / "missing.log")]) == 2
    assert "cannot read" in capsys.readouterr().err
    (tmp_path / "x.log").write_bytes(b"")
    assert main(["diagnose", "--from-log", str(tmp_path / "x.log"), "--inject", "storage-pointer-key"]) == 2
    assert "do not apply with --from-log" in capsys.readouterr().err
    assert main(["diagnose", "--from-log", str(tmp_path / "x.log")]) == 0
    assert "(no key-change events)" in capsys.readouterr().out

    run = logged("alloc")
    proc = subprocess.run([sys.executable, "-m", "runtime", "diagnose", "--from-log", "-"], input=run.log,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, timeout=300)
    assert proc.returncode == 1
    bug_lines = [line.split()[:5] for line in proc.stdout.decode().splitlines() if " BUG " in line]
    assert sorted(bug_lines) == sorted([p, s, c, "BUG", str(n)] for (p, s, c), (n, *_) in
                                       table(run.report["rows"], benign=False).items())


# ---- hostile input -------------------------------------------------------------------------------------------
def read(data: bytes):
    reader = LogReader()
    reader.feed(io.BytesIO(data), InputSummary("fuzz", "fuzz"))
    report = reader.report()
    json.dumps(report.as_dict())
    report.render().encode("ascii")  # printable anywhere: no control characters, no lone surrogates
    return report


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=3000))
def test_random_bytes_never_crash_and_every_line_is_counted(data):
    report = read(data)
    [summary] = report.inputs
    lines = data.count(b"\n") + (not data.endswith(b"\n") and len(data) > 0)
    if data.startswith(b"\x1f\x8b"):  # read as gzip: a corrupt member stops the input, and says so
        assert summary.error or summary.lines <= lines
        return
    assert summary.lines == lines and summary.error is None
    assert summary.records + sum(summary.unused.values()) >= lines


def test_mutated_records_never_crash(logged):
    records = logged("alloc").lines + logged("clean").lines
    rng = random.Random(0)
    for _ in range(400):
        data = bytearray(b"\n".join(rng.sample(records, k=min(3, len(records)))))
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(len(data))
            op = rng.randrange(4)
            if op == 0:
                data[at] = rng.randrange(256)
            elif op == 1:
                del data[at:at + rng.randint(1, 40)]
            elif op == 2:
                data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
            else:
                data[at:at] = rng.choice([b'{"', b"\n", b"\\ud800", b'"instance": "\x1b[31m", ', b"[[[[", b"1e999"])
        report = read(bytes(data))
        assert report.inputs[0].error is None


def test_hostile_values_are_tallied_safely():
    record = {"event": "loc_key_change", "policy": "memo", "site": "kv_write", "classification": "stale_loc",
              "forward_id": "7", "mode": None, "prev_site": 3, "cause": "\x1b[2J\ud800 é", "stack": ["a"],
              "key": [1, {"x": 1}], "timestamp": "not a time", "instance": "evil\x07\n"}
    data = json.dumps(record).encode() + b"\n" + json.dumps({**record, "timestamp": "9999-12-31T23:59:59Z"}).encode()
    report = read(data)
    [row] = report.rows
    assert (row.count, row.instance, row.first.forward_id) == (2, "evil\\x07\\x0a", None)
    assert "\x1b" not in report.render() and "\\x1b[2J" in row.first.cause


def test_huge_lines_are_skipped_without_losing_the_next_record(logged):
    line = logged("alloc").lines[0]
    report = read(b"y" * (5 * MAX_LINE_BYTES) + b"\n" + line + b"\n" + b"z" * (2 * MAX_LINE_BYTES))
    assert report.inputs[0].unused == {"too_long": 2} and report.inputs[0].records == 1


def test_a_cut_gzip_piece_keeps_what_was_read(logged):
    run = logged("clean")
    packed = gzip.compress(run.log * 200)
    report = read(packed[: len(packed) * 3 // 4])
    [summary] = report.inputs
    assert summary.error and "EOFError" in summary.error
    assert 0 < summary.records < 200 * len(run.lines)
