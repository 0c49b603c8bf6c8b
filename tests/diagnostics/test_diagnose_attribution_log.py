"""Attribution (issue 5, item 2): every non-benign event of a diagnose run is one structured JSON record that
names the translate call site, the site and forward that filled the entry, the mutation that made it stale
where known, and a short caller stack; one record per (site, classification), repeats counted as suppressed."""

import json

from runtime.cli import main

FIELDS = {"event", "level", "timestamp", "policy", "site", "classification", "forward_id", "mode", "prev_site",
          "prev_forward_id", "prev_mode", "cause", "key", "prev_key", "stack", "suppressed_since_last"}


def run_cli(capsys, *args):
    rc = main(["diagnose", "--json", "--log-format", "json", *args])
    out, err = capsys.readouterr()
    return rc, json.loads(out), [json.loads(line) for line in err.splitlines() if line.strip()]


def test_each_bug_event_is_one_attributed_json_record_and_repeats_are_counted(capsys):
    # guard off: the stale entry survives, so every later sliding layer repeats the event
    rc, report, records = run_cli(capsys, "--inject", "skip-forward-invalidation", "--loc-cache-guard", "off",
                                  "--policy", "memo")
    assert rc == 1
    warnings = [r for r in records if r["level"] == "warning" and r["event"] == "loc_key_change"]
    summaries = [r for r in records if r["event"] == "loc_key_change_suppressed"]  # logged at shutdown
    # the stale translation returned is used: its write lands in a slot the token does not own (the KV sanitizer)
    assert {(r["site"], r["classification"]) for r in warnings} == {("kv_write", "stale_loc"),
                                                                   ("kv_write", "cross_forward"),
                                                                   ("kv_write", "foreign_slot_write")}
    assert len(warnings) == 3  # rate-limited: one record per (site, classification) in the run
    rows = {(r["site"], r["classification"]): r for r in report["rows"] if not r["benign"]}
    foreign = next(r for r in warnings if r["classification"] == "foreign_slot_write")
    assert foreign["pool"] == "swa" and foreign["expected_owner"].startswith("the token at full slot")
    assert foreign["last_path"] and foreign["slot"] > 0 and foreign["mode"] == "graph_replay"
    for rec in (r for r in warnings if r is not foreign):
        assert FIELDS <= set(rec) and rec["event"] == "loc_key_change" and rec["policy"] == "memo"
        first = rows[rec["site"], rec["classification"]]["first"]
        # the record is the first occurrence the table shows
        assert (rec["forward_id"], rec["mode"], rec["prev_site"], rec["prev_forward_id"], rec["prev_mode"]) == (
            first["forward_id"], first["mode"], first["prev_site"], first["prev_forward_id"], first["prev_mode"])
        assert rec["site"] == "kv_write" and rec["prev_site"] == "kv_write"
        assert rec["prev_forward_id"] == rec["forward_id"] - 1 and rec["mode"] == "graph_replay"
        assert "mem_cache/swa_pool.py" in rec["stack"] and "set_kv_buffer" in rec["stack"]
        assert rec["suppressed_since_last"] == 0
    stale = next(r for r in warnings if r["classification"] == "stale_loc")
    assert stale["cause"] == "loc buffer rewritten in place" and stale["prev_mode"] == "graph_replay"
    [run] = report["runs"]
    bug_events = sum(r["count"] for r in report["rows"] if not r["benign"])
    assert bug_events > len(warnings) and run["suppressed_logs"] == bug_events - len(warnings)
    assert sum(s["suppressed_since_last"] for s in summaries) == run["suppressed_logs"]  # the log holds every one


def test_the_mutation_that_made_an_entry_stale_is_named(capsys):
    rc, report, records = run_cli(capsys, "--inject", "skip-alloc-invalidation", "--policy", "layerwise")
    assert rc == 1
    [rec] = [r for r in records if r["level"] == "warning" and r["event"] == "loc_key_change"]
    assert (rec["policy"], rec["site"], rec["classification"]) == ("layerwise", "kv_write", "stale_loc")
    assert rec["cause"] == "set_mapping wrote 16 rows without invalidating"  # the writer, not the latest mutation
    assert rec["prev_forward_id"] == rec["forward_id"] and rec["prev_site"] == "kv_write"
    assert "set_full_to_swa_mapping" in report["rows"][0]["fix"]
