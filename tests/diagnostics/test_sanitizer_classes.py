"""`swa-runtime diagnose` (strict KV sanitizer) on each slip of tests/mem_cache/test_kv_sanitizer.py: each fails
the run with a row of the sanitizer's classification, in the phase that first reaches it, whose first event
names the code path that last allocated, freed, moved or wrote the slot. A window released a token early
reaches the host offload of a retracted request first: the offload's read of the token's freed SWA side is
the event (it used to raise and stop the run)."""

import pytest

from runtime.diagnose import run_diagnose
from kv_slips import (  # tests/ is on sys.path
    backend_caches_swa_write_loc_by_address,
    fresh_rows_not_rewritten,
    loadback_compacts_without_hooks,
    locked_nodes_evictable,
    padding_not_reset,
    partial_pages_released,
    window_released_one_token_early,
)

SLIPS = {
    # slip: (a classification its row must have, the phase, what the first event's last_path or cause names)
    "stale_rows": (fresh_rows_not_rewritten, ("kv_read", "foreign_slot_read"), "scheduler", "Scheduler."),
    "backend_cache": (backend_caches_swa_write_loc_by_address, ("kv_write", "foreign_slot_write"), None, " via "),
    "laundering": (lambda mp: loadback_compacts_without_hooks(mp, {}), ("register_mapping", "stale_loc"),
                   "scheduler", "found by the load-back at register_mapping"),
    "padding": (padding_not_reset, ("kv_write", "foreign_slot_write"), None, "a padded batch entry"),  # first replay that pads
    "window_early": (window_released_one_token_early, ("kv_read", "freed_slot_read"), "scheduler",
                     "_release_window via KVSlots.free_swa"),
    "partial_pages": (partial_pages_released, ("kv_read", "freed_slot_read"), None, "free_swa via PagedAllocator.free"),
    "locked_nodes": (lambda mp: locked_nodes_evictable(mp, set()), ("kv_read", "foreign_slot_read"), "prefix_edits",
                     "KVSlots.claim"),
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
    assert names in (first.last_path or "") or names in first.cause, first
    assert any(f.startswith("memo: ") and f.endswith(f"{key[1]} event(s) at {key[0]}") for f in report.failures)
