"""EngineTracer: turns the engine's hooks into OpenTelemetry spans (imported only when tracing is on).

Every hook runs on the engine thread, so the open spans live in plain dicts without locks; the SDK's
batch processor exports from its own thread. Request phases are spans with the engine's own timestamps
(`Req.arrival_time` and friends, `time.perf_counter`), converted once to the wall clock the SDK uses.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from runtime.core import Req
from runtime.executor.forward_batch import ForwardBatch
from runtime.tracing import names
from telemetry.events import KeyChangeEvent
from telemetry.stats import BuildInfo

EXPORT_TIMEOUT_S = 5.0  # a collector that is down must not hold the engine's shutdown for long


@dataclass
class _RequestTrace:
    span: Span
    admitted: float | None = None  # first admission (perf_counter): the end of the queue phase
    retractions: int = 0


@dataclass
class _ForwardTrace:
    span: Span
    forward_id: int
    mode: str
    rids: tuple[str, ...]
    flagged: set[tuple[str, str]] = field(default_factory=set)  # (classification, site) of bug-class events


class EngineTracer:
    """The spans of one engine: request spans kept open from arrival to end (so that forwards can link to
    them), one forward span at a time, events put on the forward that is running."""

    def __init__(self, provider: TracerProvider, build: BuildInfo):
        self._provider = provider
        self._tracer = provider.get_tracer(names.TRACER_NAME, build.version)
        self._model = build.model
        self._policy = build.policy
        self._clock_offset_ns = time.time_ns() - time.perf_counter_ns()
        self._requests: dict[str, _RequestTrace] = {}
        self._forward: _ForwardTrace | None = None

    @classmethod
    def to_endpoint(cls, url: str, build: BuildInfo) -> "EngineTracer":
        """Batched OTLP/HTTP export to `url` (the OTEL_BSP_* variables tune the batching, OTEL_SERVICE_NAME
        the service's name)."""
        resource = Resource.create({
            "service.name": os.environ.get("OTEL_SERVICE_NAME", names.SERVICE_NAME),
            "service.version": build.version,
            "swa_runtime.model": build.model,
            names.LOC_CACHE_POLICY: build.policy,
            "swa_runtime.attention_backend": build.backend,
            "host.name": socket.gethostname(), "process.pid": os.getpid(),  # tells the replicas of a fleet apart
        })
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url, timeout=EXPORT_TIMEOUT_S)))
        return cls(provider, build)

    def shutdown(self) -> None:
        """End what is still open (as unfinished) and export everything queued before returning."""
        for rid in list(self._requests):
            self._requests.pop(rid).span.end()
        self._provider.shutdown()

    # ---- requests (scheduler hooks) ------------------------------------------------------------------------
    def request_arrived(self, req: Req) -> None:
        """The scheduler accepted `req`: its span starts at the request's arrival, under the client's trace
        when the request carried a W3C `traceparent`."""
        p = req.params
        parent = Context()
        if req.traceparent is not None:
            parent = TraceContextTextMapPropagator().extract({"traceparent": req.traceparent}, context=Context())
        span = self._tracer.start_span(
            names.REQUEST_SPAN, context=parent, kind=SpanKind.SERVER, start_time=self._ns(req.arrival_time),
            attributes={
                names.REQUEST_ID: req.rid, names.REQUEST_MAX_TOKENS: p.max_new_tokens,
                names.REQUEST_TEMPERATURE: p.temperature, names.REQUEST_TOP_P: p.top_p,
                names.REQUEST_TOP_K: p.top_k, names.RESPONSE_MODEL: self._model,
                names.USAGE_PROMPT_TOKENS: len(req.prompt_ids),
            })
        self._requests[req.rid] = _RequestTrace(span)

    def request_admitted(self, req: Req) -> None:
        trace = self._requests.get(req.rid)
        if trace is None:
            return
        if trace.admitted is None:
            trace.admitted = time.perf_counter()
        else:
            trace.span.add_event(names.READMITTED_EVENT)

    def request_retracted(self, req: Req, kind: str) -> None:
        trace = self._requests.get(req.rid)
        if trace is not None:
            trace.retractions += 1
            trace.span.add_event(names.RETRACTED_EVENT, {"kind": kind})

    def request_finished(self, req: Req) -> None:
        """Close the request's span with its usage and latencies, and its phases as child spans."""
        trace = self._requests.pop(req.rid, None)
        if trace is None:
            return
        now = time.perf_counter()
        span, arrival, admitted, first = trace.span, req.arrival_time, trace.admitted, req.first_token_time
        span.set_attributes({
            names.USAGE_COMPLETION_TOKENS: len(req.output_ids), names.LATENCY_E2E: now - arrival,
            names.REQUEST_STATUS: req.status, names.REQUEST_RETRACTIONS: trace.retractions,
            names.RESPONSE_FINISH_REASONS: (req.finish_reason or req.status,),
        })
        if admitted is not None:
            span.set_attribute(names.LATENCY_TIME_IN_QUEUE, admitted - arrival)
        if first is not None:
            span.set_attribute(names.LATENCY_TIME_TO_FIRST_TOKEN, first - arrival)
        if req.status == "error":
            span.set_status(Status(StatusCode.ERROR, req.error or "error"))
        parent = set_span_in_context(span)
        self._phase(names.QUEUE_SPAN, parent, arrival, admitted if admitted is not None else now)
        if admitted is not None:
            self._phase(names.PREFILL_SPAN, parent, admitted, first if first is not None else now)
        if first is not None:
            self._phase(names.DECODE_SPAN, parent, first, now)
        span.end(end_time=self._ns(now))

    def _phase(self, name: str, parent: Context, start: float, end: float) -> None:
        self._tracer.start_span(name, context=parent, start_time=self._ns(start)).end(end_time=self._ns(end))

    # ---- forwards (model runner hooks) ---------------------------------------------------------------------
    def begin_forward(self, forward_id: int, mode: str, batch: ForwardBatch | None) -> None:
        """A forward starts: its span links to the span of every request in `batch` (none for graph warm-up
        and capture runs, whose batches are padding; no batch for a multi-step scope)."""
        rids, size, tokens = (batch.rids, batch.batch_size, batch.num_tokens) if batch is not None else ((), 0, 0)
        links = [Link(trace.span.get_span_context(), {names.REQUEST_ID: rid})
                 for rid in rids if (trace := self._requests.get(rid)) is not None]
        span = self._tracer.start_span(names.FORWARD_SPAN, context=Context(), links=links, attributes={
            names.FORWARD_ID: forward_id, names.FORWARD_MODE: mode, names.FORWARD_BATCH_SIZE: size,
            names.FORWARD_TOKENS: tokens, names.LOC_CACHE_POLICY: self._policy,
        })
        self._forward = _ForwardTrace(span, forward_id, mode, rids)

    def fail_forward(self, error: BaseException) -> None:
        """The running forward raised `error`: its span records it and ends with an error status."""
        if self._forward is not None:
            self._forward.span.record_exception(error)
            self._forward.span.set_status(Status(StatusCode.ERROR, type(error).__name__))

    def end_forward(self) -> None:
        """The forward is over: each bug-class event it saw is also noted on the spans of its requests."""
        fwd, self._forward = self._forward, None
        if fwd is None:
            return
        for classification, site in sorted(fwd.flagged):
            for rid in fwd.rids:
                trace = self._requests.get(rid)
                if trace is not None:
                    trace.span.add_event(names.KV_EVENT, {"classification": classification, "site": site,
                                                          "forward_id": fwd.forward_id})
        fwd.span.end()

    def kv_event(self, event: KeyChangeEvent) -> None:
        """A key-change or sanitizer event: an event of the forward running now (outside a forward: none)."""
        fwd = self._forward
        if fwd is None:
            return
        # the record's plain fields (keys are pointer tuples; null fields stay out)
        attributes = {k: v for k, v in event.as_dict().items() if isinstance(v, (str, int, float, bool))}
        attributes.setdefault("forward_id", fwd.forward_id)
        attributes.setdefault("mode", fwd.mode)
        fwd.span.add_event(names.KV_EVENT, attributes)
        if event.classification not in names.BENIGN_CLASSIFICATIONS:
            fwd.flagged.add((event.classification, event.site))

    def _ns(self, perf_counter_s: float) -> int:
        return int(perf_counter_s * 1e9) + self._clock_offset_ns
