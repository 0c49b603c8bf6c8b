"""Connection hygiene under uvicorn's h11 protocol: time limits, a connection cap, closes the client can read.

uvicorn bounds idle kept-alive connections (`timeout_keep_alive`) but nothing else: a connection that sends
nothing, or half of its headers, holds a descriptor forever. `GuardedH11Protocol` adds:

- a header timeout: from connecting (or from the first byte of a request on a kept-alive connection) to
  the end of the headers; past it the client gets 408 and the connection closes;
- a connection cap: a connection beyond `max_connections` gets 503 at once and is closed;
- a lingering close: when the server closes while the client may still be sending (a 413 or 408 answered
  before the body was read, a refusal before the request), it half-closes, discards what still arrives for
  up to `LINGER_S`, then closes. Closing outright would reset the connection, and the reset can destroy the
  error response before the client reads it.
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

LINGER_S = 2.0


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
        self._t.write_eof()  # FIN after the pending response bytes
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

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._refusing = False
        self._header_timer: asyncio.TimerHandle | None = None
        self._lingering = _LingeringTransport(transport, self.loop, self._expects_more_input)
        super().connection_made(self._lingering)  # type: ignore[arg-type]
        if len(self.connections) > self.max_connections:
            self._refuse(503, f"too many open connections (limit {self.max_connections}); try again shortly",
                         "service_unavailable", retry_after=1)
            return
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
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._lingering.close_now()
        super().connection_lost(exc)

    # ---- internals ---------------------------------------------------------------------------------------
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
        body = json.dumps(error_body(status, message, type_)).encode()
        reason = {408: "Request Timeout", 503: "Service Unavailable"}[status]
        extra = f"retry-after: {retry_after}\r\n" if retry_after is not None else ""
        head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                f"{extra}connection: close\r\n\r\n")
        self.transport.write(head.encode() + body)
        self.transport.close()


def protocol_class(options: ServerOptions) -> type[GuardedH11Protocol]:
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {
        "header_timeout_s": options.header_timeout_s, "max_connections": options.max_connections})


def uvicorn_config(app, options: ServerOptions, *, log_level: str = "info", **kwargs) -> uvicorn.Config:
    """The uvicorn config that serves `app` with these options (the h11 protocol above, never httptools)."""
    return uvicorn.Config(app, host=options.host, port=options.port, http=protocol_class(options),
                          timeout_keep_alive=options.keep_alive_timeout_s, access_log=options.access_log,
                          log_level=log_level, lifespan="on", **kwargs)
