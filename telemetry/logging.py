"""Structured logging (structlog) and the reporter that turns key-change events into counts and logs.

Forward id and mode live in a context variable (`bind_forward`), so every record made during a forward carries
them without threading them through the call chain. It is one variable holding a tuple, set twice per forward:
structlog's `bind_contextvars` costs tens of microseconds per forward, on the hot path, for records that are
rare. Bug-class events are logged at WARNING, rate-limited per (site, classification) with suppressed repeats
counted; benign ones are counted and logged at debug.
"""

from __future__ import annotations

import logging
import socket
import sys
from contextvars import ContextVar
from typing import Any, TextIO

import structlog
from structlog.contextvars import merge_contextvars

from telemetry import names
from telemetry.events import KeyChangeEvent
from telemetry.names import fold
from telemetry.ratelimit import RateLimiter
from telemetry.stats import EngineStats

LOGGER_NAME = "swa_runtime.telemetry"


class AddInstance:
    """Stamps every record with the replica that made it, so that the logs of several replicas read together
    (`diagnose --from-log`, a log pipeline) stay attributable. Use the value Prometheus gives the replica's
    `instance` label (`host:port` of its /metrics), so that logs and metrics name a replica alike."""

    def __init__(self, instance: str):
        self.instance = instance

    def __call__(self, logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        event_dict.setdefault("instance", self.instance)
        return event_dict


def instance_of(host: str, port: int) -> str:
    """The `instance` of a server bound to `host:port`: that address, or for a wildcard bind (0.0.0.0, ::)
    this machine's host name, which is what deployments scrape it by (a compose service's `hostname`, a
    Kubernetes pod name relabelled into `instance`), so that no two replicas log the same instance."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    return f"{host}:{port}"


def configure_logging(fmt: str = "json", level: str | int = "INFO", stream: TextIO | None = None,
                      instance: str | None = None) -> None:
    """Configure structlog process-wide: contextvars, level, ISO UTC timestamp, the `instance` field when
    given (see `AddInstance`), then JSON or console output."""
    if fmt not in ("json", "console"):
        raise ValueError(f"log format must be 'json' or 'console', got {fmt!r}")
    level_no = level if isinstance(level, int) else logging.getLevelName(level.upper())
    if not isinstance(level_no, int):
        raise ValueError(f"unknown log level {level!r}")
    stream = stream if stream is not None else sys.stderr
    processors: list[Any] = [
        *CONTEXT_PROCESSORS,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if instance is not None:
        processors.append(AddInstance(instance))
    if fmt == "json":
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=stream.isatty()))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=True,
    )


_FORWARD: ContextVar[tuple[int, str] | None] = ContextVar("swa_runtime_forward", default=None)


def bind_forward(forward_id: int, mode: str) -> None:
    """Tag every record made in this context (thread or task) with the current forward."""
    _FORWARD.set((forward_id, mode))


def clear_forward() -> None:
    _FORWARD.set(None)


def add_forward(logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """Processor: the bound forward's `forward_id` and `mode`, unless the record names its own."""
    current = _FORWARD.get()
    if current is not None:
        event_dict.setdefault("forward_id", current[0])
        event_dict.setdefault("mode", current[1])
    return event_dict


# What every configuration starts with: structlog's context variables, then the forward.
CONTEXT_PROCESSORS = (merge_contextvars, add_forward)


def _is_enabled(logger: Any, level: int) -> bool:
    check = getattr(logger, "is_enabled_for", None)
    return True if check is None else bool(check(level))


class EventReporter:
    """Counts every key-change event, logs the bug-class ones, and remembers the first of each kind.

    The first occurrence per (site, classification) is kept (at most `max_first_events` of them) for
    diagnostics, whatever the rate limiter decided about logging it.
    """

    def __init__(
        self,
        stats: EngineStats,
        limiter: RateLimiter,
        logger: Any = None,
        max_first_events: int = 64,
    ):
        self._stats = stats
        self._limiter = limiter
        self._log = logger if logger is not None else structlog.get_logger(LOGGER_NAME)
        self._max_first = max_first_events
        self._first: dict[tuple[str, str], KeyChangeEvent] = {}
        self._suppressed_since: dict[tuple[str, str], int] = {}
        self._policy: dict[tuple[str, str], str] = {}

    def report(self, event: KeyChangeEvent) -> None:
        site = fold(event.site, names.TRANSLATE_SITE_LABELS)
        classification = fold(event.classification, names.CLASSIFICATION_LABELS)
        self._stats.translation.key_change(site, classification)
        key = (site, classification)
        if key not in self._first and len(self._first) < self._max_first:
            self._first[key] = event
        if classification == "benign_fresh_tensor":
            if _is_enabled(self._log, logging.DEBUG):
                self._log.debug(names.LOC_KEY_CHANGE_EVENT, **_log_fields(event))
            return
        if not self._limiter.allow(key):
            self._stats.log_suppressed(names.LOC_KEY_CHANGE_EVENT)
            self._suppressed_since[key] = self._suppressed_since.get(key, 0) + 1
            self._policy[key] = event.policy
            return
        self._log.warning(
            names.LOC_KEY_CHANGE_EVENT,
            suppressed_since_last=self._suppressed_since.pop(key, 0),
            **_log_fields(event),
        )

    def flush(self) -> None:
        """Log the repeats still held back, one summary record per (site, classification): at shutdown, so
        a log read back holds every event the engine counted."""
        for (site, classification), n in self._suppressed_since.items():
            if n:
                self._log.warning(names.LOC_KEY_CHANGE_SUPPRESSED_EVENT, policy=self._policy[site, classification],
                                  site=site, classification=classification, suppressed_since_last=n)
        self._suppressed_since.clear()

    def first_events(self) -> list[KeyChangeEvent]:
        """The first event of each (site, classification) seen, in order of first occurrence."""
        return list(self._first.values())


def _log_fields(event: KeyChangeEvent) -> dict[str, Any]:
    # forward_id and mode left as None are filled from the forward bound by bind_forward.
    fields = event.as_dict()
    for name in ("forward_id", "mode"):
        if fields[name] is None:
            del fields[name]
    return fields
