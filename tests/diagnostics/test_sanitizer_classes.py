"""`swa-runtime diagnose` (strict KV sanitizer) on the slips of tests/mem_cache/test_kv_sanitizer.py that its
workload reaches: each fails the run with a row of the sanitizer's classification, whose first event names
the code path that last allocated, freed or moved the slot. Not reached: graph padding (the workload's graph
sizes cover every decode batch exactly, so it never pads); the window released a token early also breaks
the host offload of a retracted request in the scheduler phase (it raises), so the run stops there, and
tests/mem_cache/test_kv_sanitizer.py shows it counted instead."""

import pytest

from runtime.diagnose import run_diagnose
from kv_slips import (  # tests/ is on sys.path
    backend_caches_swa_write_loc_by_address,
    fresh_rows_not_rewritten,
    loadback_compacts_without_hooks,
)

SLIPS = {
    # slip: (a classification its row must have, the phase, what the first event's last_path or cause names)
    "stale_rows": (fresh_rows_not_rewritten, ("kv_read", "foreign_slot_read"), "scheduler", "Scheduler."),
    "backend_cache": (backend_caches_swa_write_loc_by_address, ("kv_write", "foreign_slot_write"), None, " via "),
    "laundering": (lambda mp: loadback_compacts_without_hooks(mp, {}), ("register_mapping", "stale_loc"),
                   "scheduler", "found by the load-back at register_mapping"),
}


@pytest.mark.parametrize("name", SLIPS)
def test_diagnose_fails_with_the_sanitizer_row_of_each_slip_it_reaches(name, monkeypatch):
    slip, key, phase, names = SLIPS[name]
    slip(monkeypatch)
    report = run_diagnose(policies=("memo",))
    assert report.exit_status == 1
    rows = {(r.site, r.classification): r for r in report.rows}
    assert key in rows, sorted(rows)
    row = rows[key]
    assert row.count >= 1 and (phase is None or row.phase == phase)
    first = row.first
    assert names in (first.last_path or first.cause), first
    assert any(f.startswith("memo: ") and f.endswith(f"{key[1]} event(s) at {key[0]}") for f in report.failures)
