"""Attribution (issue 5, item 2): every non-benign event of a diagnose run is one structured JSON record that
names the translate call site, the site and forward that filled the entry, the mutation that made it stale
where known, and a short caller stack; one record per (site, classification) and engine (each workload setup
runs one), repeats counted as suppressed."""

import json
import re

from runtime.cli import main
from runtime.diagnose import SETUPS

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
    # rate-limited: one record per (site, classification) in each engine whose setup runs a phase that shows it:
    # decode replays (reserved_decode) and verify replays (reserved_verify) back to back over reserved slots
    engines = [s.name for s in SETUPS if {"reserved_decode", "reserved_verify"} & set(s.phases)]
    assert engines == ["base", "paged", "wide"] and len(warnings) == 3 * len(engines)
    assert {r["mode"] for r in warnings} == {"graph_replay", "target_verify"}
    rows = {(r["site"], r["classification"]): r for r in report["rows"] if not r["benign"]}
    foreign = [r for r in warnings if r["classification"] == "foreign_slot_write"]
    for rec in foreign:
        assert rec["pool"] == "swa" and rec["expected_owner"].startswith("the token at full slot")
        assert rec["last_path"] and rec["slot"] > 0 and rec["mode"] in ("graph_replay", "target_verify")
    seen = set()
    for rec in (r for r in warnings if r not in foreign):
        assert FIELDS <= set(rec) and rec["event"] == "loc_key_change" and rec["policy"] == "memo"
        first = rows[rec["site"], rec["classification"]]["first"]
        if (rec["site"], rec["classification"]) not in seen:  # the first engine's record is the table's first
            seen.add((rec["site"], rec["classification"]))
            assert first["setup"] == "base" and first["phase"] == "reserved_decode"
            assert (rec["forward_id"], rec["mode"], rec["prev_site"], rec["prev_forward_id"], rec["prev_mode"]) == (
                first["forward_id"], first["mode"], first["prev_site"], first["prev_forward_id"], first["prev_mode"])
        assert rec["site"] == "kv_write" and rec["prev_site"] == "kv_write"
        # the previous forward filled the entry, except that a verify replay after a stale hit (guard off: the
        # stale value returned, the entry not refilled) finds the entry of the replay before it
        behind = 2 if (rec["mode"], rec["classification"]) == ("target_verify", "cross_forward") else 1
        assert rec["prev_forward_id"] == rec["forward_id"] - behind and rec["mode"] in ("graph_replay", "target_verify")
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
    recs = [r for r in records if r["level"] == "warning" and r["event"] == "loc_key_change"]
    assert len(recs) == 2  # one per engine running the midforward_remap phase (base, paged)
    for rec in recs:
        assert (rec["policy"], rec["site"], rec["classification"]) == ("layerwise", "kv_write", "stale_loc")
        # the writer, not the latest mutation
        assert re.fullmatch(r"set_mapping wrote \d+ rows without invalidating", rec["cause"]), rec["cause"]
        assert rec["prev_forward_id"] == rec["forward_id"] and rec["prev_site"] == "kv_write"
    assert "set_full_to_swa_mapping" in report["rows"][0]["fix"]
