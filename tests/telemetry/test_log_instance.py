"""The `instance` field of log records: every record of a replica carries it, and logs of two replicas read
together by `diagnose --from-log` are attributed per instance (even interleaved in one file)."""

from __future__ import annotations

import io
import json
import socket

import structlog

from runtime.diagnose.from_log import diagnose_logs
from telemetry import names
from telemetry.logging import bind_forward, configure_logging, instance_of


def records(instance: str | None) -> list[dict]:
    stream = io.StringIO()
    configure_logging("json", "INFO", stream=stream, instance=instance)
    log = structlog.get_logger("t")
    log.info("started")
    bind_forward(7, "eager_decode")
    log.warning(names.LOC_KEY_CHANGE_EVENT, policy="memo", site="kv_write", classification="stale_loc",
                suppressed_since_last=0)
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_every_record_names_its_instance_and_none_without_one():
    tagged = records("127.0.0.1:30001")
    assert [r["instance"] for r in tagged] == ["127.0.0.1:30001"] * 2
    assert tagged[1]["forward_id"] == 7 and tagged[1]["classification"] == "stale_loc"
    assert all("instance" not in r for r in records(None))


def test_a_record_that_names_its_own_instance_keeps_it():
    stream = io.StringIO()
    configure_logging("json", "INFO", stream=stream, instance="127.0.0.1:30001")
    structlog.get_logger("t").info("forwarded", instance="10.0.0.9:30000")
    assert json.loads(stream.getvalue())["instance"] == "10.0.0.9:30000"


def test_two_replicas_in_one_interleaved_log_are_told_apart(tmp_path):
    a, b = records("127.0.0.1:30001"), records("127.0.0.1:30002")
    mixed = tmp_path / "fleet.log"
    mixed.write_text("".join(json.dumps(r) + "\n" for pair in zip(a, b) for r in pair))
    report = diagnose_logs([str(mixed)]).as_dict()
    rows = [(r["instance"], r["classification"], r["count"]) for r in report["rows"]]
    assert sorted(rows) == [("127.0.0.1:30001", "stale_loc", 1), ("127.0.0.1:30002", "stale_loc", 1)]


def test_instance_is_the_bound_address_or_the_host_name_for_a_wildcard():
    assert instance_of("127.0.0.1", 30001) == "127.0.0.1:30001"
    assert instance_of("0.0.0.0", 30000) == instance_of("::", 30000) == f"{socket.gethostname()}:30000"
