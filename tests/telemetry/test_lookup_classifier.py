"""The lookup classifier against rules 2-8 of docs/translation-rules.md, one rule at a time and against an
independent re-statement."""

import dataclasses
import itertools
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from telemetry import names
from telemetry.events import LookupFacts, caller_stack, classify_lookup

# A clean hit: an entry filled earlier in this forward from this very view, nothing changed since.
CLEAN = LookupFacts(
    has_entry=True,
    invalidated_since_fill=False,
    capturing=False,
    entry_before_capture_run=False,
    same_key=True,
    same_view=True,
    guard_equal=True,
    entry_from_earlier_forward=False,
)


def facts(**changes) -> LookupFacts:
    return dataclasses.replace(CLEAN, **changes)


def verdict(f: LookupFacts, guard: bool = True) -> tuple:
    v = classify_lookup(f, guard)
    return (v.hit, v.reason, v.classification, v.use_cached)


HIT = (True, None, None, True)


@pytest.mark.parametrize(
    "f, expected",
    [
        pytest.param(CLEAN, HIT, id="rule8-hit"),
        pytest.param(facts(has_entry=False), (False, "cold", None, False), id="rule2-cold"),
        pytest.param(
            facts(has_entry=False, invalidated_since_fill=True), (False, "invalidated", None, False), id="rule2-inv"
        ),
        pytest.param(
            facts(capturing=True, entry_before_capture_run=True),
            (False, "capture", "capture_pollution", False),
            id="rule3-capture-pollution",
        ),
        pytest.param(facts(capturing=True), HIT, id="rule3-filled-in-this-capture-run-is-a-hit"),
        pytest.param(facts(entry_before_capture_run=True), HIT, id="rule3-needs-capturing"),
        pytest.param(facts(same_view=False), (False, "key_changed", "view_offset", False), id="rule4-view-offset"),
        pytest.param(facts(guard_equal=False), (False, "stale_guard", "stale_loc", False), id="rule5-stale"),
        pytest.param(facts(entry_from_earlier_forward=True), (True, None, "cross_forward", True), id="rule6-same-key"),
        pytest.param(
            facts(entry_from_earlier_forward=True, same_key=False),
            (False, "key_changed", "cross_forward", False),
            id="rule6-other-key",
        ),
        pytest.param(facts(same_key=False), (False, "key_changed", "benign_fresh_tensor", False), id="rule7-benign"),
        # A different key says nothing about the view or guard of the old entry: still benign.
        pytest.param(
            facts(same_key=False, same_view=False, guard_equal=False),
            (False, "key_changed", "benign_fresh_tensor", False),
            id="rule7-ignores-view-and-guard",
        ),
    ],
)
def test_each_rule(f, expected):
    assert verdict(f) == expected


@pytest.mark.parametrize(
    "f, expected",
    [
        pytest.param(
            facts(guard_equal=False, entry_from_earlier_forward=True),
            (False, "stale_guard", "stale_loc", False),
            id="stale-beats-cross-forward",
        ),
        pytest.param(
            facts(capturing=True, entry_before_capture_run=True, same_view=False),
            (False, "capture", "capture_pollution", False),
            id="capture-beats-view-offset",
        ),
        pytest.param(
            facts(capturing=True, entry_before_capture_run=True, guard_equal=False, entry_from_earlier_forward=True),
            (False, "capture", "capture_pollution", False),
            id="capture-beats-stale-and-cross-forward",
        ),
        pytest.param(
            facts(same_view=False, guard_equal=False),
            (False, "key_changed", "view_offset", False),
            id="view-offset-beats-stale",
        ),
        pytest.param(
            facts(has_entry=False, invalidated_since_fill=True, capturing=True, entry_before_capture_run=True),
            (False, "invalidated", None, False),
            id="no-entry-beats-everything",
        ),
    ],
)
def test_precedence(f, expected):
    assert verdict(f) == expected


def test_guard_off_returns_the_stale_value_but_still_classifies_it():
    assert verdict(facts(guard_equal=False), guard=False) == (True, None, "stale_loc", True)
    assert verdict(facts(guard_equal=False, entry_from_earlier_forward=True), guard=False) == (
        True,
        None,
        "stale_loc",
        True,
    )


def test_guard_off_changes_nothing_else():
    assert verdict(CLEAN, guard=False) == HIT
    assert verdict(facts(same_view=False), guard=False) == (False, "key_changed", "view_offset", False)
    assert verdict(facts(capturing=True, entry_before_capture_run=True, guard_equal=False), guard=False) == (
        False,
        "capture",
        "capture_pollution",
        False,
    )


def test_verdicts_are_shared_objects():
    """The hot path must not allocate: the same situation yields the very same verdict object."""
    assert classify_lookup(CLEAN) is classify_lookup(facts())
    assert classify_lookup(facts(same_key=False)) is classify_lookup(facts(same_key=False, same_view=False))


def documented_rules(f: LookupFacts, guard: bool) -> tuple:
    """Rules 2-8 of docs/translation-rules.md re-stated as written, as (hit, reason, classification, use_cached)."""
    if not f.has_entry:
        return (False, "invalidated" if f.invalidated_since_fill else "cold", None, False)
    elif f.capturing and f.entry_before_capture_run:
        return (False, "capture", "capture_pollution", False)
    elif f.same_key and not f.same_view:
        return (False, "key_changed", "view_offset", False)
    elif f.same_key and not f.guard_equal:
        return (True, None, "stale_loc", True) if not guard else (False, "stale_guard", "stale_loc", False)
    elif f.entry_from_earlier_forward and f.same_key:
        return (True, None, "cross_forward", True)
    elif f.entry_from_earlier_forward:
        return (False, "key_changed", "cross_forward", False)
    elif not f.same_key:
        return (False, "key_changed", "benign_fresh_tensor", False)
    else:
        return (True, None, None, True)


@given(f=st.builds(LookupFacts, *[st.booleans()] * 8), guard=st.booleans())
def test_matches_documented_restatement(f, guard):
    assert verdict(f, guard) == documented_rules(f, guard)
    # Equal facts (a distinct but equal object) yield the very same shared verdict object.
    assert classify_lookup(dataclasses.replace(f), guard) is classify_lookup(f, guard)


def test_every_verdict_is_consistent_with_the_label_sets():
    for bits in itertools.product((False, True), repeat=9):
        v = classify_lookup(LookupFacts(*bits[:8]), guard=bits[8])
        assert (v.reason is None) == v.hit
        assert v.reason is None or v.reason in names.MISS_REASONS
        assert v.classification is None or v.classification in names.CLASSIFICATIONS
        # Only a hit returns the cached value, and only the guard-off stale hit returns a wrong one.
        assert v.use_cached == v.hit


def _inner():
    return caller_stack(0, limit=2), sys._getframe().f_lineno


def _outer():
    return _inner(), sys._getframe().f_lineno


def test_caller_stack_lists_frames_innermost_last():
    (stack, inner_line), outer_line = _outer()
    here = "telemetry/test_lookup_classifier.py"
    assert stack == f"{here}:{outer_line} _outer > {here}:{inner_line} _inner"


def test_caller_stack_skip_drops_inner_frames():
    def helper():
        return caller_stack(1, limit=1)

    line = sys._getframe().f_lineno + 1
    stack = helper()
    assert stack == f"telemetry/test_lookup_classifier.py:{line} test_caller_stack_skip_drops_inner_frames"
