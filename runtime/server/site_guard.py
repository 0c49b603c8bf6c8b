"""Host and Origin checks: a server on the user's machine must not serve web pages it never met.

Two browser attacks reach a server bound to loopback. A page on any site can POST to it (a form or `fetch`
with a simple content type; the JSON content type the endpoints require already forces a CORS preflight),
and a DNS-rebinding page (a name of the attacker's that now resolves to 127.0.0.1) can also read the
answers, because the browser believes it talks to the attacker's own origin. So:

- Host: answered only for IP addresses (a rebinding page uses a name, never an IP), `localhost` (and
  `*.localhost`, which browsers resolve to loopback themselves), the bound host name, and the names given
  with `--allowed-hosts` (`*` turns the check off). A request without a Host header (HTTP/1.0) passes.
  A server bound to every interface (`--host 0.0.0.0`, as in a container scraped as `runtime:30000`) is
  reachable by any name the network gives it, so it checks Host only when `--allowed-hosts` lists names;
  the Origin check below still refuses cross-site browser requests there.
- Origin: a request carrying an Origin header (browsers send it on cross-origin requests and on every
  POST) must come from the server's own origin (the Origin's host:port equals the checked Host) or one
  given with `--allowed-origins` (`*`: any). Non-browser clients send no Origin and pass.

Refusals are 403 with the usual error body, before any route runs.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.server.protocol import error_body

WILDCARD_ADDRESSES = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class SitePolicy:
    bound_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()

    def host_refusal(self, host_header: str | None) -> str | None:
        """Why a request with this Host header is refused, or None if it is answered."""
        if host_header is None or "*" in self.allowed_hosts:
            return None
        if not self.allowed_hosts and self.bound_host.strip("[]") in WILDCARD_ADDRESSES:
            return None
        name = _hostname(host_header)
        if name is not None and self._known_host(name):
            return None
        return (f"Host {host_header!r} is not served here: use an IP address or localhost, or start the server "
                "with --allowed-hosts naming it")

    def origin_refusal(self, origin: str | None, host_header: str | None) -> str | None:
        """Why a request with this Origin header is refused, or None if it is answered."""
        if origin is None:
            return None
        normalized = origin.strip().lower().rstrip("/")
        if "*" in self.allowed_origins or normalized in self.allowed_origins:
            return None
        parts = urlsplit(normalized) if "://" in normalized else None
        if parts is not None and host_header is not None and parts.netloc == host_header.strip().lower():
            return None  # the server's own origin
        return (f"cross-origin request from {origin!r} refused; start the server with --allowed-origins "
                f"{origin.strip()} to allow it")

    def _known_host(self, name: str) -> bool:
        if name == "localhost" or name.endswith(".localhost") or name in self.allowed_hosts:
            return True
        if self.bound_host.lower() not in WILDCARD_ADDRESSES and name == self.bound_host.lower().strip("[]"):
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


def _hostname(host_header: str) -> str | None:
    try:
        parts = urlsplit(f"//{host_header.strip()}")
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError:
        return None
    return parts.hostname


class SiteGuard:
    """ASGI middleware applying a `SitePolicy` to every HTTP request."""

    def __init__(self, app: ASGIApp, policy: SitePolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            host = headers.get("host")
            why = self.policy.host_refusal(host) or self.policy.origin_refusal(headers.get("origin"), host)
            if why is not None:
                response = JSONResponse(error_body(403, why, "permission_error"), status_code=403)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
