"""Connection hygiene under uvicorn's h11 protocol: time limits, a connection cap, closes the client can read.

uvicorn bounds idle kept-alive connections (`timeout_keep_alive`) but nothing else: a connection that sends
nothing, or half of its headers, holds a descriptor forever. `GuardedH11Protocol` adds:

- a header timeout: from connecting (or from the first byte of a request on a kept-alive connection) to
  the end of the headers; past it the client gets 408 and the connection closes;
- a connection cap that sheds idle connections first: beyond `max_connections`, the connection idle the
  longest without a request under way (one still sending its headers, a slowloris, or an idle kept-alive
  one) is answered 503 and closed to make room; only when every connection carries a request does the newcomer
  get a place in a small reserve (`reserve_connections`) that serves `/health` and `/metrics` only, and
  beyond that a 503 at once. A connection flood cannot take the health check away from a router;
- a lingering close: when the server closes while the client may still be sending (a 413 or 408 answered
  before the body was read, a refusal before the request), it half-closes, discards what still arrives for
  up to `LINGER_S`, then closes. Closing outright would reset the connection, and the reset can destroy the
  error response before the client reads it. A client already gone (reset) is closed at once;
- a half-close is not a disconnect: a client that sends its request and shuts its write side still gets
  the answer (then the connection closes). Since a client that closed its socket looks the same until the
  server writes, a request still waiting for its answer probes every `PROBE_S` with an interim
  `102 Processing` (clients skip 1xx answers); a client that is really gone answers with a reset, which
  reads as a disconnect and aborts the request, as a closed connection always does.
Every answer sent here (408, 503, uvicorn's 400 for unparsable HTTP) counts in the front end's
`swa_runtime_http_responses_total`; `RefuseAmbiguousFraming` refuses Content-Length with Transfer-Encoding.
The body timeout is the app's (it reads the body); see `runtime/server/body.py`.
"""

from __future__ import annotations

import asyncio
import json

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from runtime.server.options import ServerOptions
from runtime.server.protocol import error_body
from runtime.server.response_counts import CountResponses
from telemetry.stats import FrontEndStats

LINGER_S = 2.0
PROBE_S = 0.5
RESERVED_PATHS = ("/health", "/metrics")


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: `close()` lingers when `should_linger()` says so."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, should_linger):
        self._t = transport
        self._loop = loop
        self._should_linger = should_linger
        self.lingering = False
        self._timer: asyncio.TimerHandle | None = None

    def close(self) -> None:
        if self.lingering or self._t.is_closing():
            return
        if not (self._should_linger() and self._t.can_write_eof()):
            self._t.close()
            return
        self.lingering = True
        try:
            self._t.write_eof()  # FIN after the pending response bytes
        except OSError:  # the client is gone already (reset, not connected): nothing to linger for
            self._t.close()
            return
        self._t.resume_reading()  # keep draining what the client still sends
        self._timer = self._loop.call_later(LINGER_S, self._t.close)

    def is_closing(self) -> bool:
        return self.lingering or self._t.is_closing()

    def close_now(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._t.close()

    def __getattr__(self, name):
        return getattr(self._t, name)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the limits above (class attributes set by `protocol_class`)."""

    header_timeout_s = 10.0
    max_connections = 512
    reserve_connections = 8
    stats = FrontEndStats()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._refusing = False
        self._header_timer: asyncio.TimerHandle | None = None
        self._probe: asyncio.TimerHandle | None = None
        self._idle_since = self.loop.time()
        self._lingering = _LingeringTransport(transport, self.loop, self._expects_more_input)
        super().connection_made(self._lingering)  # type: ignore[arg-type]
        if len(self.connections) > self.max_connections:
            idle = self._longest_idle()
            full = f"too many open connections (limit {self.max_connections}); try again shortly"
            if idle is not None:
                idle._refuse(503, full, "service_unavailable", retry_after=1)
            elif len(self.connections) > self.max_connections + self.reserve_connections:
                self._refuse(503, full, "service_unavailable", retry_after=1)
                return
            else:
                self.app = _ReservedPathsOnly(self.app, full, self.stats)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._lingering.lingering or self._refusing:
            return  # draining before the close
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # a new request begins on a kept-alive connection
        super().data_received(data)
        if self._header_timer is not None and self.conn.their_state is not h11.IDLE:
            self._cancel_header_timer()  # the headers are complete

    def eof_received(self) -> bool | None:
        if self._lingering.lingering:
            self._lingering.close_now()  # the client has read our answer and closed its side
            return None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and self.conn.their_state is h11.DONE:
            cycle.keep_alive = False  # a half-close after a whole request: answer, then close
            self._probe = self.loop.call_later(PROBE_S, self._probe_peer)
            return True
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        if self._probe is not None:
            self._probe.cancel()
        self._lingering.close_now()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self._idle_since = self.loop.time()
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        self.stats.record_response(400)
        super().send_400_response(msg)

    # ---- internals ---------------------------------------------------------------------------------------
    def _idle(self) -> bool:
        """No request under way: waiting for (the rest of) its headers, or kept alive between requests."""
        busy = self.cycle is not None and not self.cycle.response_complete
        return not busy and not self._refusing and not self._lingering.is_closing()

    def _longest_idle(self) -> "GuardedH11Protocol | None":
        idle = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol) and c._idle()]
        return min(idle, key=lambda c: c._idle_since, default=None)

    def _probe_peer(self) -> None:
        """A half-closed connection waits for its answer: write `102 Processing` so that a client that is
        really gone resets the connection (the next write then fails and the request is aborted)."""
        self._probe = None
        cycle = self.cycle
        if cycle is None or cycle.response_started or cycle.response_complete or self.transport.is_closing():
            return
        self.transport.write(self.conn.send(h11.InformationalResponse(status_code=102, headers=[])))
        self._probe = self.loop.call_later(PROBE_S, self._probe_peer)

    def _expects_more_input(self) -> bool:
        """The client may still be sending: we refuse before its request, or answered before its body ended."""
        return self._refusing or self.conn.their_state is h11.SEND_BODY

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._refuse(408, f"no complete request headers within {self.header_timeout_s:g} s", "timeout_error")

    def _refuse(self, status: int, message: str, type_: str, retry_after: int | None = None) -> None:
        """Answer outside h11 (no request was parsed) and close; the client reads it as the reply."""
        self._refusing = True
        self._cancel_header_timer()
        self.stats.record_response(status)
        body = json.dumps(error_body(status, message, type_)).encode()
        reason = {408: "Request Timeout", 503: "Service Unavailable"}[status]
        extra = f"retry-after: {retry_after}\r\n" if retry_after is not None else ""
        head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                f"{extra}connection: close\r\n\r\n")
        self.transport.write(head.encode() + body)
        self.transport.close()


class _ReservedPathsOnly:
    """The ASGI app of a connection admitted into the reserve: /health and /metrics, 503 for anything else."""

    def __init__(self, app, message: str, stats: FrontEndStats):
        self.app, self.message, self.stats = app, message, stats

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in RESERVED_PATHS:
            return await self.app(scope, receive, send)
        self.stats.record_response(503)
        await _send_json(send, 503, error_body(503, self.message, "service_unavailable"), retry_after=True)


class RefuseAmbiguousFraming:
    """ASGI middleware: 400 (and close) for a request with both Content-Length and Transfer-Encoding. Two
    framings of one body are how requests are smuggled past a proxy that reads the other one."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            given = {name for name, _ in scope["headers"]}
            if b"content-length" in given and b"transfer-encoding" in given:
                message = "Content-Length and Transfer-Encoding together are refused: send one of them"
                return await _send_json(send, 400, error_body(400, message, "invalid_request_error"))
        await self.app(scope, receive, send)


async def _send_json(send, status: int, body: dict, retry_after: bool = False) -> None:
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
               (b"connection", b"close")] + ([(b"retry-after", b"1")] if retry_after else [])
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})


def protocol_class(options: ServerOptions, stats: FrontEndStats | None = None) -> type[GuardedH11Protocol]:
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {
        "header_timeout_s": options.header_timeout_s, "max_connections": options.max_connections,
        "stats": stats if stats is not None else FrontEndStats()})


def uvicorn_config(app, options: ServerOptions, *, log_level: str = "info", **kwargs) -> uvicorn.Config:
    """The uvicorn config that serves `app` (made by `create_app`) with these options: the h11 protocol above
    (never httptools), every answer counted in the app's front-end stats, ambiguous framing refused."""
    stats = app.state.front_end_stats
    wrapped = CountResponses(RefuseAmbiguousFraming(app), stats)
    return uvicorn.Config(wrapped, host=options.host, port=options.port, http=protocol_class(options, stats),
                          timeout_keep_alive=options.keep_alive_timeout_s, access_log=options.access_log,
                          log_level=log_level, lifespan="on", **kwargs)
