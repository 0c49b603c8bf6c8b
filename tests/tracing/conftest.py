"""A loopback OTLP/HTTP trace receiver: what a collector would get, decoded with opentelemetry-proto."""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

try:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )
except ImportError:  # the test extra is missing: the tests that need a receiver skip (see `otlp_receiver`)
    ExportTraceServiceRequest = ExportTraceServiceResponse = None


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict
    events: list  # [(name, attributes)]
    links: list  # [(trace_id, span_id, attributes)]
    status_code: int  # 0 unset, 1 ok, 2 error
    resource: dict


def _value(v):
    which = v.WhichOneof("value")
    if which == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, which) if which else None


def _attributes(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode(body: bytes) -> list[Span]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for rs in request.resource_spans:
        resource = _attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(Span(
                    name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex(), kind=s.kind, start_ns=s.start_time_unix_nano,
                    end_ns=s.end_time_unix_nano, attributes=_attributes(s.attributes),
                    events=[(e.name, _attributes(e.attributes)) for e in s.events],
                    links=[(link.trace_id.hex(), link.span_id.hex(), _attributes(link.attributes))
                           for link in s.links],
                    status_code=s.status.code, resource=resource))
    return spans


class OTLPReceiver:
    """POST /v1/traces on 127.0.0.1 (a free port): decodes every export and keeps the spans."""

    def __init__(self):
        if ExportTraceServiceRequest is None:
            pytest.skip("opentelemetry-proto is not installed (pip install 'swa-runtime[test]')")
        self.spans: list[Span] = []
        self.paths: list[str] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                with receiver._lock:
                    receiver.paths.append(self.path)
                    if self.path == "/v1/traces":
                        receiver.spans.extend(decode(body))
                code = 200 if self.path == "/v1/traces" else 404
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(code)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def named(self, name: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.name == name]

    def wait_for(self, name: str, count: int, timeout_s: float = 30.0) -> list[Span]:
        deadline = time.monotonic() + timeout_s
        while len(self.named(name)) < count:
            assert time.monotonic() < deadline, f"{len(self.named(name))} {name!r} spans received, {count} expected"
            time.sleep(0.05)
        return self.named(name)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def otlp_receiver():
    receiver = OTLPReceiver()
    yield receiver
    receiver.close()
