"""The admin token: what a client must show to change server state for others (`/abort_request`).

Off by default: without `--admin-token` (or `SWA_RUNTIME_ADMIN_TOKEN`) every state-changing route answers
403, so no client can cancel another's request by guessing its id. With a token, such a route needs
`Authorization: Bearer <token>` (401 otherwise, compared in constant time).
"""

from __future__ import annotations

import hmac

from starlette.requests import Request

from runtime.server.protocol import APIError


class AdminToken:
    def __init__(self, token: str | None):
        self._token = None if token is None else token.encode()

    def require(self, request: Request) -> None:
        """Return if `request` carries the admin token; raise the 403 or 401 to answer otherwise."""
        if self._token is None:
            raise APIError(403, f"{request.url.path} is disabled: start the server with --admin-token "
                                "(or SWA_RUNTIME_ADMIN_TOKEN) to allow it", "permission_error")
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token):
            raise APIError(401, f"{request.url.path} needs the admin token: Authorization: Bearer <token>",
                           "authentication_error", headers={"WWW-Authenticate": "Bearer"})
