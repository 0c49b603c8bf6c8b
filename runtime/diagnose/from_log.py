"""`swa-runtime diagnose --from-log`: the diagnose table rebuilt from the structured logs of running engines.

Reads what `--log-format json` writes (one JSON object per line; the `loc_key_change` record is described in
docs/metrics.md) as production keeps it: rotated pieces concatenated or given one by one (plain or gzip),
other events and other services' lines interleaved, lines prefixed by a log collector (`docker compose logs`,
Kubernetes' CRI files), records cut short by a writer that died mid-line and possibly followed by the next
record on the same line, blank lines, garbage. Every line is accounted for: used, or counted by why not.

Each `loc_key_change` record is one occurrence and adds the repeats its `suppressed_since_last` says the rate
limiter dropped before it; a `loc_key_change_suppressed` record (a summary of repeats dropped after a pair's
last record, for builds that write one) adds its `suppressed_since_last` alone. Site, classification and
policy fold into the closed label sets, as the metrics do; cause strings are shown as logged, never parsed.
The first occurrence of a row is its earliest record by timestamp (then by reading order).

Several inputs can come from several replicas: a record's `instance` field names its replica; failing that,
a `docker compose logs` prefix (`runtime-2  | {...}`); failing that, the input's file name (rotation
suffixes such as `.1` or `-20250101.gz` dropped, so the pieces of one log stay one instance).
"""

from __future__ import annotations

import os
import re
import zlib
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import BinaryIO

from runtime.diagnose.log_lines import MAX_LINE_BYTES, clean, read_lines, split_line
from runtime.diagnose.report import BENIGN, Row, render_rows, render_verdict, row_totals
from runtime.mem_cache.translation import ONE_OFF_SITE
from telemetry import names
from telemetry.events import KeyChangeEvent

SUMMARY_EVENT = names.LOC_KEY_CHANGE_SUPPRESSED_EVENT
LINE_KINDS = {  # why a piece of a line was not used, as the report says it
    "other_json": "JSON, not a key-change event",
    "not_json": "not JSON",
    "truncated": "truncated",
    "malformed_event": "key-change record with unusable fields",
    "too_long": f"longer than {MAX_LINE_BYTES >> 20} MiB",
}
_COMPOSE_PREFIX = re.compile(r"\s*([A-Za-z0-9][\w.-]*)\s*\|")
_ROTATED = re.compile(r"(.+?\.(?:log|jsonl?|txt|out|err))(?:[.-][0-9][0-9._T:-]*)?(?:\.gz)?")


# ---- records ------------------------------------------------------------------------------------------------
def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _count(value: object) -> int | None:
    """A suppressed-repeat count: absent means 0; anything but a non-negative integer is unusable."""
    if value is None:
        return 0
    n = _int(value)
    return n if n is not None and n >= 0 else None


def _when(record: dict) -> float | None:
    stamp = record.get("timestamp")
    if not isinstance(stamp, str) or len(stamp) > 64:
        return None
    try:
        when = datetime.fromisoformat(stamp)
        return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()
    except (ValueError, OverflowError, OSError):
        return None


def _key(value: object) -> tuple | None:
    if not isinstance(value, list):
        return None
    return tuple(v if _int(v) is not None else clean(v, 40) for v in value[:4])


def _event(record: dict) -> KeyChangeEvent:
    """The key-change event a record describes (fields as logged, made safe to print)."""
    return KeyChangeEvent(
        policy=clean(record.get("policy"), 40) or names.OTHER, site=clean(record["site"], 40),
        classification=clean(record["classification"], 40), forward_id=_int(record.get("forward_id")),
        mode=clean(record.get("mode"), 40), prev_site=clean(record.get("prev_site"), 40),
        prev_forward_id=_int(record.get("prev_forward_id")), prev_mode=clean(record.get("prev_mode"), 40),
        cause=clean(record.get("cause"), 1000), key=_key(record.get("key")) or (),
        prev_key=_key(record.get("prev_key")), stack=clean(record.get("stack")) or "",
        slot=_int(record.get("slot")), pool=clean(record.get("pool"), 10),
        expected_owner=clean(record.get("expected_owner"), 200), actual_owner=clean(record.get("actual_owner"), 200),
        last_path=clean(record.get("last_path"), 200))


# ---- one report over every input ----------------------------------------------------------------------------
@dataclass
class InputSummary:
    """What one input gave: lines read, key-change records used, suppressed repeats carried, the rest."""

    name: str
    instance: str  # where its records go when they name no instance
    lines: int = 0
    records: int = 0
    suppressed: int = 0
    unused: Counter = field(default_factory=Counter)  # LINE_KINDS and "blank"
    error: str | None = None  # why reading stopped early
    named: dict = field(default_factory=dict)  # instances its records named (an ordered set)
    objects: int = 0  # JSON objects found, used or not

    @property
    def instances(self) -> list[str]:
        """The replicas this input holds: those its records name, else the one its name stands for."""
        return list(self.named) or [self.instance]

    def as_dict(self) -> dict:
        return {"input": self.name, "instances": self.instances, "lines": self.lines, "records": self.records,
                "suppressed_repeats": self.suppressed, "unused": dict(self.unused), "error": self.error}


@dataclass
class _Tally:
    count: int = 0
    first: dict | None = None
    first_at: tuple = (2,)  # (0, timestamp, order) or (1, 0, order): timestamped records order first


class LogReader:
    """Feeds inputs one at a time and tallies (instance, policy, site, classification)."""

    def __init__(self):
        self.inputs: list[InputSummary] = []
        self.tallies: dict[tuple[str, str, str, str], _Tally] = {}
        self.one_off: set[tuple[str, str]] = set()  # (instance, policy) where window_indices hit the cache
        self.summaries = 0  # SUMMARY_EVENT records seen
        self.mentions = 0  # unusable pieces that are or mention a key-change record
        self._order = 0

    def feed(self, stream: BinaryIO, summary: InputSummary) -> None:
        self.inputs.append(summary)
        try:
            for raw in read_lines(stream):
                summary.lines += 1
                self._line(raw, summary)
        except (OSError, EOFError, zlib.error) as exc:  # a corrupt or cut gzip member, a read error
            summary.error = clean(f"{type(exc).__name__}: {exc}", 200)

    def _line(self, raw: bytes | None, summary: InputSummary) -> None:
        if raw is None:
            summary.unused["too_long"] += 1
            return
        text = raw.decode("utf-8", errors="replace").strip()
        if not text:
            summary.unused["blank"] += 1
            return
        pieces, prefix = split_line(text)
        match = _COMPOSE_PREFIX.match(prefix)
        for kind, value in pieces:
            if kind == "json":
                kind = self._record(value, summary, clean(match.group(1), 200) if match else None)
            if kind is not None:
                summary.unused[kind] += 1
                if kind == "malformed_event" or (kind != "other_json" and names.LOC_KEY_CHANGE_EVENT in value):
                    self.mentions += 1

    def _record(self, record: object, summary: InputSummary, prefix_instance: str | None) -> str | None:
        """Tally one JSON value; return why it was not used, or None."""
        if not isinstance(record, dict):
            return "other_json"
        summary.objects += 1
        event = record.get("event")
        named = clean(record.get("instance"), 200) or prefix_instance
        if named and isinstance(event, str):  # a structlog record of some replica, whatever it says
            summary.named[named] = None
        if event not in (names.LOC_KEY_CHANGE_EVENT, SUMMARY_EVENT):
            return "other_json"
        site, classification = record.get("site"), record.get("classification")
        policy = record.get("policy", names.OTHER)
        repeats = _count(record.get("suppressed_since_last"))
        if not all(isinstance(v, str) for v in (site, classification, policy)) or repeats is None:
            return "malformed_event"
        instance = named or summary.instance
        summary.named[instance] = None
        key = (instance, names.fold(policy, names.POLICIES), names.fold(site, names.TRANSLATE_SITE_LABELS),
               names.fold(classification, names.CLASSIFICATION_LABELS))
        tally = self.tallies.setdefault(key, _Tally())
        tally.count += repeats
        summary.suppressed += repeats
        summary.records += 1
        if event == SUMMARY_EVENT:
            self.summaries += 1
            return None
        tally.count += 1
        self._order += 1
        when = _when(record)
        at = (0, when, self._order) if when is not None else (1, 0.0, self._order)
        if at < tally.first_at:
            tally.first, tally.first_at = record, at
        if ONE_OFF_SITE in (site, record.get("prev_site")):
            self.one_off.add(key[:2])
        return None

    def report(self) -> LogReport:
        """Rows in the workload's order (bug classes first, then site), per instance in order of appearance."""
        instances = {name: i for i, name in enumerate(dict.fromkeys(n for s in self.inputs for n in s.instances))}
        policies = {p: i for i, p in enumerate(names.POLICIES)}

        def order(key):
            instance, policy, site, classification = key
            return (instances[instance], policies.get(policy, len(policies)),
                    classification == BENIGN, site, classification)

        rows = []
        for key in sorted(self.tallies, key=order):
            instance, policy, site, classification = key
            tally = self.tallies[key]
            first = _event(tally.first) if tally.first is not None else None
            rows.append(Row(policy, site, classification, tally.count, first, None, instance))
        one_off = sorted(self.one_off, key=lambda k: (instances[k[0]], k[1]))
        return LogReport(self.inputs, list(instances), rows, one_off, self.summaries, self.mentions)


@dataclass
class LogReport:
    inputs: list[InputSummary]
    instances: list[str]  # every replica the inputs hold, in order of appearance
    rows: list[Row]
    one_off: list[tuple[str, str]]  # (instance, policy) whose one-off translation went through the cache
    summaries: int  # summary records of suppressed repeats
    mentions: int  # unusable pieces that are or mention a key-change record

    @property
    def several(self) -> bool:
        return len(self.instances) > 1

    def _who(self, instance: str, policy: str) -> str:
        return f"{instance} {policy}" if self.several else policy

    @property
    def failures(self) -> list[str]:
        out = [f"{self._who(r.instance, r.policy)}: {r.count} {r.classification} event(s) at {r.site}"
               for r in self.rows if not r.benign]
        return out + [f"{self._who(*k)}: the one-off `{ONE_OFF_SITE}` translation went through the cache "
                      "(docs/translation-rules.md rule 1)" for k in self.one_off]

    @property
    def exit_status(self) -> int:
        return 1 if self.failures else 0

    def unused(self) -> Counter:
        total = Counter()
        for s in self.inputs:
            total.update(s.unused)
        return total

    def notes(self) -> list[str]:
        notes, unused = [], self.unused()
        if sum(s.lines for s in self.inputs) > unused["blank"] and not sum(s.objects for s in self.inputs):
            notes.append("no line held a JSON object: read logs written with --log-format json")
        if self.mentions:
            notes.append(f"{self.mentions} unusable line piece(s) are or mention a {names.LOC_KEY_CHANGE_EVENT} record: "
                         "events may be missing from the table")
        if any(not r.benign for r in self.rows) and not self.summaries:
            notes.append("bug-class counts are lower bounds: the rate limiter reports dropped repeats only on the "
                         "next record of the same site and classification, so repeats after the last one are not "
                         "in the log (swa_runtime_loc_key_change_events_total has every event)")
        if not any(r.benign for r in self.rows):
            notes.append("benign events are logged at DEBUG: they appear only in logs written with --log-level debug")
        return notes + [f"reading {s.name} stopped early: {s.error}" for s in self.inputs if s.error]

    def as_dict(self) -> dict:
        return {"source": "log", "inputs": [s.as_dict() for s in self.inputs], "instances": self.instances,
                "lines": {"read": sum(s.lines for s in self.inputs), "records": sum(s.records for s in self.inputs),
                          "suppressed_repeats": sum(s.suppressed for s in self.inputs),
                          "unused": dict(self.unused())},
                "rows": [r.as_dict() for r in self.rows], "totals": {**row_totals(self.rows),
                                                                     "failures": len(self.failures)},
                "notes": self.notes(), "failures": self.failures, "exit_status": self.exit_status}

    def render(self) -> str:
        lines = [f"swa-runtime diagnose --from-log: {len(self.inputs)} input(s), "
                 f"instance(s) {', '.join(self.instances)}"]
        for s in self.inputs:
            lines.append(f"  {s.name}: {s.lines} lines, {s.records} key-change records"
                         + (f" (+{s.suppressed} suppressed repeats)" if s.suppressed else "")
                         + (f", instance(s) {', '.join(s.instances)}" if self.several else ""))
        unused = self.unused()
        lines.append("lines not used: " + (", ".join(f"{unused[k]} {text}" for k, text in LINE_KINDS.items()
                                                     if unused[k]) or "none")
                     + (f"; {unused['blank']} blank" if unused["blank"] else ""))
        lines += ["", *render_rows(self.rows, show_instance=self.several), ""]
        lines += render_verdict(row_totals(self.rows), self.failures, self.exit_status)
        return "\n".join(lines + [f"note: {n}" for n in self.notes()])


# ---- entry point --------------------------------------------------------------------------------------------
def instance_names(paths: list[str]) -> dict[str, str]:
    """The instance each path stands for: its file name less any rotation suffix, with as many parent
    directories as it takes to tell different logs apart (a/server.log, b/server.log)."""
    keys = {}
    for path in paths:
        name = os.path.basename(path)
        match = _ROTATED.fullmatch(name)
        name = match.group(1) if match else name.removesuffix(".gz")
        parts = os.path.normpath(os.path.dirname(os.path.abspath(path))).split(os.sep)
        keys[path] = [p for p in parts if p] + [name]
    distinct = {tuple(k) for k in keys.values()}
    out = {}
    for path, key in keys.items():
        depth = 1
        while depth < len(key) and sum(1 for d in distinct if d[-depth:] == tuple(key[-depth:])) > 1:
            depth += 1
        out[path] = clean("/".join(key[-depth:]), 200)
    return out


def diagnose_logs(paths: list[str], stdin: BinaryIO | None = None) -> LogReport:
    """Read every input (`-` is `stdin`) and build the report. An input that cannot be opened is a ValueError
    (said before anything is read); one given twice is read once."""
    seen, todo = set(), []
    for path in paths:
        ident = "-" if path == "-" else os.path.realpath(path)
        if ident not in seen:
            seen.add(ident)
            todo.append(path)
    names_of = instance_names([p for p in todo if p != "-"])
    streams = []
    try:
        for path in todo:
            if path == "-":
                if stdin is None:
                    raise ValueError("--from-log -: no standard input")
                streams.append((stdin, InputSummary("stdin", "stdin")))
                continue
            try:
                streams.append((open(path, "rb"), InputSummary(clean(path, 500), names_of[path])))
            except OSError as exc:
                raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
        reader = LogReader()
        for stream, summary in streams:
            reader.feed(stream, summary)
        return reader.report()
    finally:
        for stream, _ in streams:
            if stream is not stdin:
                stream.close()
