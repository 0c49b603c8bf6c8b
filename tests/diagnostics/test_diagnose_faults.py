"""Each fault switch, through the diagnose workload: the expected classification at the expected site and
nothing else non-benign; with the guard on the outputs equal the clean run; with the guard off the faults
that can corrupt do (and sampled verification catches them), the others cannot, for the reason stated.

Where the workload's phases matter (see runtime/diagnose/__init__.py):
- skip-forward-invalidation shows only in `reserved_decode` and `reserved_verify`: in the scheduler phase every
  forward follows an allocation whose invalidation hook also empties the cache. A replay after an eager
  forward is `cross_forward` (different tensor); a replay after a replay of the same static buffer is
  `stale_loc` (the buffer's version moved with `copy_`; rule 5 outranks rule 6). `layerwise` refills at the
  first sliding layer of every forward, so it is immune.
- skip-register-mapping-invalidation and skip-alloc-invalidation show only in `midforward_remap`: the
  engine's own load-back runs between forwards and allocates (an invalidating mutation) before it registers an
  identical clone, so there both are masked and harmless.
- skip-capture-invalidation cannot corrupt here: the CPU static-buffer replay re-runs the model in Python on
  every replay, so nothing a capture "recorded" is reused (on CUDA graphs the missing gather would be).
- storage-pointer-key cannot corrupt here: an entry remembers the exact view it was filled from and rule 4
  recomputes on a collision whatever the guard says.
- window-buffer-pollution raises only benign events (the window entry is replaced by the write location before
  any sliding layer reads it), so diagnose flags it through its one-off check (docs/translation-rules.md
  rule 1), not a bug row.
"""

import pytest

from telemetry.names import POLICIES

# fault -> policy -> {(site, classification)} of non-benign events, and (phase, mode, prev_mode, cause) of the
# first occurrence of each.
EXPECTED = {
    "skip-forward-invalidation": {
        "memo": {
            ("kv_write", "cross_forward"): ("reserved_decode", "graph_replay", "eager_decode", None),
            ("kv_write", "stale_loc"): ("reserved_decode", "graph_replay", "graph_replay",
                                        "loc buffer rewritten in place"),
        },
    },
    "skip-capture-invalidation": {
        "memo": {("kv_write", "capture_pollution"): ("graph_capture", "graph_capture", "graph_capture", None)},
    },
    "skip-register-mapping-invalidation": {
        policy: {("kv_write", "stale_loc"): ("midforward_remap", "graph_replay", "graph_replay",
                                             "register_mapping registered a rebuilt mapping without invalidating")}
        for policy in ("memo", "layerwise")
    },
    "storage-pointer-key": {
        "memo": {("kv_write", "view_offset"): ("draft_steps", "eager_decode", "eager_decode", None)},
    },
    "window-buffer-pollution": {},
    "skip-alloc-invalidation": {
        policy: {("kv_write", "stale_loc"): ("midforward_remap", "graph_replay", "graph_replay",
                                             "set_mapping wrote 16 rows without invalidating")}
        for policy in ("memo", "layerwise")
    },
}
# fault -> the (setup, phase) pairs whose outputs a stale hit corrupts with the guard off (absent: cannot corrupt
# here): every setup that runs the phase
REMAP = {("base", "midforward_remap"), ("paged", "midforward_remap")}
CORRUPTS = {
    "skip-forward-invalidation": {("base", "reserved_decode"), ("paged", "reserved_decode"),
                                  ("wide", "reserved_verify")},
    "skip-register-mapping-invalidation": REMAP,
    "skip-alloc-invalidation": REMAP,
}


def non_benign(report, policy):
    return {(r.site, r.classification): r for r in report.rows if r.policy == policy and not r.benign}


def by_policy(report):
    return {p.policy: p for p in report.policies}


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_guard_on_classifies_the_fault_at_its_site_and_outputs_equal_the_uncached_run(diagnose, fault):
    report = diagnose(fault)
    runs = by_policy(report)
    for policy in POLICIES:
        expected = EXPECTED[fault].get(policy, {})
        rows = non_benign(report, policy)
        assert set(rows) == set(expected), policy
        for key, (phase, mode, prev_mode, cause) in expected.items():
            row = rows[key]
            e = row.first
            assert row.count >= 1 and row.phase == phase
            assert (e.mode, e.prev_mode, e.cause) == (mode, prev_mode, cause)
            assert e.prev_site == "kv_write" and e.prev_forward_id <= e.forward_id
            assert "set_kv_buffer" in e.stack
        run = runs[policy]
        assert run.mismatches == [], policy  # tokens and logits equal the ground truth
        assert run.reference == "the dense reference"
    assert report.exit_status == 1


def test_stale_loc_of_a_reused_replay_buffer_comes_from_the_previous_forward(diagnose):
    rows = non_benign(diagnose("skip-forward-invalidation"), "memo")
    stale, cross = rows["kv_write", "stale_loc"].first, rows["kv_write", "cross_forward"].first
    assert stale.prev_forward_id == stale.forward_id - 1 and stale.key == stale.prev_key
    assert cross.prev_forward_id == cross.forward_id - 1 and cross.key != cross.prev_key


def test_mid_forward_remap_is_caught_within_the_forward_that_filled_the_entry(diagnose):
    for fault in ("skip-register-mapping-invalidation", "skip-alloc-invalidation"):
        for policy in ("memo", "layerwise"):
            e = non_benign(diagnose(fault), policy)["kv_write", "stale_loc"].first
            assert e.prev_forward_id == e.forward_id


def test_window_buffer_pollution_is_benign_per_event_but_fails_the_one_off_check(diagnose):
    report = diagnose("window-buffer-pollution")
    memo = [r for r in report.rows if r.policy == "memo"]
    assert memo and all(r.benign for r in memo)
    first = {(r.site, r.classification): r.first for r in memo}
    # every forward: the window indices fill the entry, the write location evicts it
    assert first["kv_write", "benign_fresh_tensor"].prev_site == "window_indices"
    assert ("window_indices", "benign_fresh_tensor") in first  # a second step of one forward looked it up
    assert report.failures == [
        "memo: the one-off `window_indices` translation went through the cache (docs/translation-rules.md rule 1)"
    ]
    assert report.exit_status == 1


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_guard_off(diagnose, fault):
    affected = [p for p in ("memo", "layerwise") if EXPECTED[fault].get(p)]
    report = diagnose(fault, guard=False, policies=("memo", "layerwise"))
    runs = by_policy(report)
    for policy in ("memo", "layerwise"):
        if fault in CORRUPTS and policy in affected:
            # stale hits returned: the sliding layers wrote KV to slots attention does not read, each in a
            # phase whose events say so
            mismatches = runs[policy].mismatches
            assert {(m.setup, m.phase) for m in mismatches} == CORRUPTS[fault]
            assert all(m.max_logit_diff > 0.1 for m in mismatches)
            assert not any(m.undetected for m in mismatches)
            assert ("kv_write", "stale_loc") in non_benign(report, policy)
        else:
            assert runs[policy].mismatches == []


@pytest.mark.parametrize("fault", sorted(CORRUPTS))
def test_guard_off_corruption_is_caught_by_full_verification(diagnose, fault):
    report = diagnose(fault, guard=False, verify=1.0, policies=("memo", "layerwise"))
    for policy in ("memo", "layerwise"):
        run = by_policy(report)[policy]
        if EXPECTED[fault].get(policy):
            assert run.result.stale_guard_misses > 0  # a verified hit disagreed; the fresh value won
            assert ("kv_write", "stale_loc") in non_benign(report, policy)
        assert run.mismatches == []
