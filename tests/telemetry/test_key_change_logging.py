"""EventReporter: counts, structured WARNING records with forward context, rate limiting, first events."""

import io
import json
import logging
from datetime import datetime

import pytest
import structlog

from telemetry import names
from telemetry.collector import make_registry
from telemetry.events import KeyChangeEvent
from telemetry.logging import EventReporter, bind_forward, clear_forward, configure_logging
from telemetry.ratelimit import RateLimiter


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def event(site="kv_write", classification="stale_loc", **changes) -> KeyChangeEvent:
    fields = dict(
        policy="memo",
        site=site,
        classification=classification,
        forward_id=None,
        mode=None,
        prev_site="attn_metadata",
        prev_forward_id=6,
        prev_mode="eager_extend",
        cause="set_mapping",
        key=(140000, 8),
        prev_key=(140000, 8),
        stack="executor/model_runner.py:88 forward > mem_cache/swa_pool.py:51 translate",
    )
    fields.update(changes)
    return KeyChangeEvent(**fields)


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def reporter(stats, clock):
    return EventReporter(stats, RateLimiter(interval_s=60.0, burst=1, clock=clock))


def warnings(capture):
    return [r for r in capture.records if r["level"] == "warning"]


def test_warning_carries_forward_context_and_every_event_field(stats, reporter, capture_logs_at):
    capture = capture_logs_at(logging.INFO)
    bind_forward(7, "eager_decode")
    reporter.report(event())
    assert capture.records == [
        {
            "event": "loc_key_change",
            "level": "warning",
            "forward_id": 7,
            "mode": "eager_decode",
            "policy": "memo",
            "site": "kv_write",
            "classification": "stale_loc",
            "prev_site": "attn_metadata",
            "prev_forward_id": 6,
            "prev_mode": "eager_extend",
            "cause": "set_mapping",
            "key": (140000, 8),
            "prev_key": (140000, 8),
            "stack": "executor/model_runner.py:88 forward > mem_cache/swa_pool.py:51 translate",
            "suppressed_since_last": 0,
        }
    ]
    assert stats.translation.key_change_counts["kv_write", "stale_loc"] == 1


def test_event_forward_fields_win_over_context_and_clear_forward_unbinds(reporter, capture_logs_at):
    capture = capture_logs_at(logging.INFO)
    bind_forward(7, "eager_decode")
    reporter.report(event(forward_id=5, mode="graph_replay"))
    clear_forward()
    reporter.report(event(site="attn_metadata"))
    first, second = capture.records
    assert (first["forward_id"], first["mode"]) == (5, "graph_replay")
    assert "forward_id" not in second and "mode" not in second


def test_repeats_are_rate_limited_per_site_and_classification_and_counted(stats, reporter, clock, capture_logs_at):
    capture = capture_logs_at(logging.INFO)
    registry = make_registry(stats)
    for _ in range(3):
        reporter.report(event())
    reporter.report(event(classification="cross_forward"))  # another key: its own budget
    reporter.report(event(site="window_indices"))
    assert [(r["site"], r["classification"]) for r in warnings(capture)] == [
        ("kv_write", "stale_loc"),
        ("kv_write", "cross_forward"),
        ("window_indices", "stale_loc"),
    ]
    assert stats.suppressed_counts == {"loc_key_change": 2, "engine_step_failed": 0, "other": 0}
    assert registry.get_sample_value(names.LOG_EVENTS_SUPPRESSED, {"event": "loc_key_change"}) == 2
    # Every event is counted, logged or not.
    assert stats.translation.key_change_counts["kv_write", "stale_loc"] == 3
    assert registry.get_sample_value(
        names.LOC_KEY_CHANGE_EVENTS, {"policy": "memo", "site": "kv_write", "classification": "stale_loc"}
    ) == 3

    clock.now += 59.0
    reporter.report(event())
    assert len(warnings(capture)) == 3
    clock.now += 1.0
    reporter.report(event())
    assert len(warnings(capture)) == 4
    assert warnings(capture)[-1]["suppressed_since_last"] == 3
    assert stats.suppressed_counts["loc_key_change"] == 3


def test_benign_events_are_counted_and_logged_at_debug_only(stats, reporter, capture_logs_at):
    capture = capture_logs_at(logging.DEBUG)
    for _ in range(3):
        reporter.report(event(site="attn_metadata", classification="benign_fresh_tensor"))
    assert [r["level"] for r in capture.records] == ["debug"] * 3  # not rate-limited, never a warning
    assert stats.translation.key_change_counts["attn_metadata", "benign_fresh_tensor"] == 3
    assert stats.suppressed_counts["loc_key_change"] == 0


def test_benign_events_skip_the_log_call_when_debug_is_off(stats, clock):
    class InfoOnly:
        def is_enabled_for(self, level):
            return level >= logging.INFO

        def debug(self, *args, **kwargs):
            raise AssertionError("debug called although disabled")

    reporter = EventReporter(stats, RateLimiter(60.0, clock=clock), logger=InfoOnly())
    reporter.report(event(classification="benign_fresh_tensor"))
    assert stats.translation.key_change_counts["kv_write", "benign_fresh_tensor"] == 1


def test_unknown_labels_fold_but_the_event_is_still_a_warning(stats, reporter, capture_logs_at):
    capture = capture_logs_at(logging.INFO)
    reporter.report(event(site="mystery_site", classification="weird"))
    assert stats.translation.key_change_counts["other", "other"] == 1
    (record,) = warnings(capture)
    assert (record["site"], record["classification"]) == ("mystery_site", "weird")


def test_first_events_keeps_the_first_of_each_kind_in_order(stats, clock):
    reporter = EventReporter(stats, RateLimiter(60.0, clock=clock), max_first_events=3)
    a1 = event(prev_forward_id=1)
    a2 = event(prev_forward_id=2)
    b = event(classification="cross_forward")
    c = event(site="attn_metadata", classification="benign_fresh_tensor")
    d = event(site="window_indices")
    for e in (a1, a2, b, c, a2, d):
        reporter.report(e)
    assert reporter.first_events() == [a1, b, c]  # bounded at 3: d is dropped


def test_configure_logging_json_output(capture_logs_at):
    stream = io.StringIO()
    configure_logging("json", "INFO", stream=stream)
    bind_forward(3, "graph_replay")
    log = structlog.get_logger("t")
    log.debug("hidden")
    log.warning("shown", a=1)
    (line,) = stream.getvalue().splitlines()
    record = json.loads(line)
    assert {k: record[k] for k in ("event", "level", "a", "forward_id", "mode")} == {
        "event": "shown",
        "level": "warning",
        "a": 1,
        "forward_id": 3,
        "mode": "graph_replay",
    }
    assert datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).tzinfo is not None


def test_configure_logging_console_and_bad_arguments():
    stream = io.StringIO()
    configure_logging("console", "DEBUG", stream=stream)
    structlog.get_logger("t").debug("hello", a=1)
    out = stream.getvalue()
    assert "hello" in out and "a=1" in out and "debug" in out
    with pytest.raises(ValueError):
        configure_logging("xml")
    with pytest.raises(ValueError):
        configure_logging("json", "LOUD")
