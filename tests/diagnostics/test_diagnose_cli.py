"""`swa-runtime diagnose`: exit 0 and no bug-class row on a clean build; exit 1 naming the right site and
classification for each fault switch; the same through `python -m runtime`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.cli import main
from runtime.faults import FAULTS

ROOT = Path(__file__).resolve().parents[2]

# fault -> (policy, site, classification) rows the report must name (the full expectations, first
# occurrences included, are in test_diagnose_faults.py)
NAMED = {
    "skip-forward-invalidation": {("memo", "kv_write", "cross_forward"), ("memo", "kv_write", "stale_loc")},
    "skip-capture-invalidation": {("memo", "kv_write", "capture_pollution")},
    "skip-register-mapping-invalidation": {("memo", "kv_write", "stale_loc"), ("layerwise", "kv_write", "stale_loc")},
    "storage-pointer-key": {("memo", "kv_write", "view_offset")},
    "window-buffer-pollution": set(),  # benign events only; the one-off check fails
    "skip-alloc-invalidation": {("memo", "kv_write", "stale_loc"), ("layerwise", "kv_write", "stale_loc")},
}


def test_every_fault_switch_is_covered():
    assert set(NAMED) == set(FAULTS)


def test_clean_build_exits_0_with_no_bug_rows(capsys):
    assert main(["diagnose"]) == 0
    text = capsys.readouterr().out
    assert "BUG" not in text and "non-benign events: 0" in text and "-> exit 0" in text
    for policy in ("memo", "layerwise", "per_forward", "off"):
        assert f"outputs {policy:<12}equal" in text


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_fault_exits_1_and_names_site_and_classification(capsys, fault):
    assert main(["diagnose", "--inject", fault, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["exit_status"] == 1 and report["inject"] == [fault]
    bugs = {(r["policy"], r["site"], r["classification"]) for r in report["rows"] if not r["benign"]}
    assert bugs == NAMED[fault]
    assert report["totals"]["non_benign_events"] == sum(r["count"] for r in report["rows"] if not r["benign"])
    for row in report["rows"]:
        assert row["fix"] and row["first"]["forward_id"] is not None
    assert all(run["outputs_equal"] for run in report["runs"])  # guard on: nothing corrupted
    if fault == "window-buffer-pollution":
        assert any("one-off `window_indices`" in f for f in report["failures"])


def test_table_names_the_site_and_classification(capsys):
    assert main(["diagnose", "--inject", "skip-capture-invalidation", "--policy", "memo"]) == 1
    text = capsys.readouterr().out
    line = next(l for l in text.splitlines() if "capture_pollution" in l)
    assert line.split()[:4] == ["memo", "kv_write", "capture_pollution", "BUG"]
    assert "fix:   invalidate at the start of every graph warm-up/capture run" in text


def test_module_entry_point_exit_status():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "runtime", "diagnose", "--policy", "memo"]
    clean = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert clean.returncode == 0, clean.stderr
    faulty = subprocess.run(cmd + ["--inject", "storage-pointer-key"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert faulty.returncode == 1 and "view_offset" in faulty.stdout
