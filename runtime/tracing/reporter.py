"""The event reporter of a traced engine: counts and logs as ever, and adds each event to the forward span."""

from __future__ import annotations

from telemetry.events import KeyChangeEvent
from telemetry.logging import EventReporter


class TracingEventReporter(EventReporter):
    """`EventReporter` that also hands every event (key-change and sanitizer alike) to the tracer, which
    records it on the running forward's span: the forward links to its requests, so the event does too."""

    def __init__(self, *args, tracer, **kwargs):
        super().__init__(*args, **kwargs)
        self._tracer = tracer

    def report(self, event: KeyChangeEvent) -> None:
        super().report(event)
        self._tracer.kv_event(event)
