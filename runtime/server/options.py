"""Server options: what `swa-runtime serve` bounds and allows, as one frozen config and its argparse group.

The defaults are safe for a server on a developer's machine: bound to loopback, answering only to local
Host names and IP addresses, refusing browser requests from other origins, with bounded bodies, queues,
connections and read timeouts.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields

ADMIN_TOKEN_ENV = "SWA_RUNTIME_ADMIN_TOKEN"


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 30000
    shutdown_timeout_s: float = 30.0
    access_log: bool = False
    max_request_bytes: int = 4 * 1024 * 1024
    max_queued_requests: int = 256  # requests waiting for a place in the running batch
    max_connections: int = 512
    header_timeout_s: float = 10.0  # from connecting (or from the first byte of a kept-alive request) to headers
    body_timeout_s: float = 30.0  # from the headers to the last byte of the body
    keep_alive_timeout_s: float = 5.0  # an idle kept-alive connection is closed after this
    allowed_hosts: tuple[str, ...] = ()  # Host names answered besides localhost and IP addresses; "*": any
    allowed_origins: tuple[str, ...] = ()  # browser origins allowed (CORS); "*": any
    enable_api_docs: bool = False
    log_requests: bool = False  # prompts and token ids in the logs
    request_timeout_s: float = 600.0  # from acceptance to the last token; then aborted, 504 or an error event
    admin_token: str | None = field(default=None, repr=False)  # Bearer token of state-changing routes; None: off
    engine_heartbeat_timeout_s: float = 3.0  # the engine process unanswered this long: down (503)
    engine_hang_kill_s: float = 30.0  # down this long: killed and restarted
    engine_max_restarts: int = 5  # restarts within 10 minutes before `serve` exits non-zero

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_queued_requests", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ValueError("--admin-token must be at least 16 characters (a guessable token guards nothing)")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.removesuffix('_s').replace('_', '-')} must be > 0 seconds")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerOptions":
        """The options in `args` (the serve command's); options a namespace lacks keep their defaults."""
        given = vars(args)
        renamed = {"shutdown_timeout": "shutdown_timeout_s", "header_timeout": "header_timeout_s",
                   "body_timeout": "body_timeout_s", "keep_alive_timeout": "keep_alive_timeout_s",
                   "request_timeout": "request_timeout_s", "engine_heartbeat_timeout": "engine_heartbeat_timeout_s",
                   "engine_hang_kill": "engine_hang_kill_s"}
        values = {renamed.get(k, k): v for k, v in given.items()}
        if values.get("admin_token") is None and os.environ.get(ADMIN_TOKEN_ENV):
            values["admin_token"] = os.environ[ADMIN_TOKEN_ENV]
        names = {f.name for f in fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in names}
        return cls(**values)


def _names(text: str) -> list[str]:
    return [part.strip().lower().rstrip("/") for part in text.split(",") if part.strip()]


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Limits and site checks of `swa-runtime serve` (besides --host, --port, --shutdown-timeout, --access-log)."""
    d = ServerOptions()
    g = p.add_argument_group("limits and site checks")
    g.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes, metavar="BYTES",
                   help="larger bodies are answered 413 before they are read (default 4 MiB)")
    g.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests, metavar="N",
                   help="requests that may wait for a place in the running batch; more get 429 with Retry-After")
    g.add_argument("--max-connections", type=int, default=d.max_connections, metavar="N",
                   help="open connections; more are answered 503 and closed")
    g.add_argument("--header-timeout", type=float, default=d.header_timeout_s, metavar="SECONDS",
                   help="a request's headers must arrive within this (else 408 and close)")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout_s, metavar="SECONDS",
                   help="a request's body must arrive within this after its headers (else 408 and close)")
    g.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout_s, metavar="SECONDS",
                   help="close a kept-alive connection idle for this long")
    g.add_argument("--allowed-hosts", type=_names, default=[], metavar="NAMES",
                   help="comma-separated Host names to answer besides localhost and IP addresses ('*': any)")
    g.add_argument("--allowed-origins", type=_names, default=[], metavar="ORIGINS",
                   help="comma-separated browser origins allowed to call the API, e.g. http://localhost:8080 "
                        "('*': any); requests from other origins get 403")
    g.add_argument("--enable-api-docs", action="store_true", help="serve /docs, /redoc and /openapi.json")
    g.add_argument("--log-requests", action="store_true",
                   help="log each request's prompt and output token ids (at INFO: add --log-level INFO); "
                        "without it logs carry no prompts or token ids")
    add_supervision_args(p)


def add_supervision_args(p: argparse.ArgumentParser) -> None:
    """Request deadlines, the admin token and engine supervision of `swa-runtime serve` (docs/serving.md)."""
    d = ServerOptions()
    g = p.add_argument_group("deadlines, admin token and engine supervision")
    g.add_argument("--request-timeout", type=float, default=d.request_timeout_s, metavar="SECONDS",
                   help="a request still running this long after it was accepted is aborted (504, or an error "
                        "event when streaming); default 600")
    g.add_argument("--admin-token", default=None, metavar="TOKEN",
                   help=f"Bearer token that state-changing routes (/abort_request) require; without it (or "
                        f"${ADMIN_TOKEN_ENV}) they answer 403. Prefer the environment variable: arguments are "
                        "visible to other users of the machine")
    g.add_argument("--engine-heartbeat-timeout", type=float, default=d.engine_heartbeat_timeout_s,
                   metavar="SECONDS", help="the engine process unanswered this long counts as down (/health 503)")
    g.add_argument("--engine-hang-kill", type=float, default=d.engine_hang_kill_s, metavar="SECONDS",
                   help="an engine process down (hung) this long is killed and restarted")
    g.add_argument("--engine-max-restarts", type=int, default=d.engine_max_restarts, metavar="N",
                   help="engine restarts allowed within 10 minutes; one more and serve exits with status 3")
