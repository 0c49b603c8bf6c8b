"""`--api-key`: the inference routes answer only requests with `Authorization: Bearer <key>`.

Guarded: /v1/* (as vLLM guards it) and /generate (the same engine, by another door). Open: /health and
/metrics (load balancers and Prometheus carry no key), and the router's read-only info routes. A missing or
wrong key gets 401 with OpenAI's error body, before the body is read. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
import json

GUARDED_PREFIXES = ("/v1/", "/generate")


class APIKeyGuard:
    """Pure ASGI middleware (a streaming response keeps its own view of the client's disconnect)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GUARDED_PREFIXES) or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        why = "wrong API key" if given else "missing API key"
        body = json.dumps({"error": {"message": f"{why}: send `Authorization: Bearer <key>` with the key the "
                                                "server was started with (--api-key)",
                                     "type": "authentication_error", "code": 401}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
