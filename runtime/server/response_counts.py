"""Every HTTP answer counted by status code (`swa_runtime_http_responses_total{code}`), refusals included.

The engine counts the requests it saw (`swa_runtime_requests_total`); requests refused before it (a foreign
Origin, a wrong content type, a body too large, malformed JSON, an unknown route, a full queue, a dead
engine) are only visible here. The outermost ASGI layer sees every status the app sends; answers sent
outside the app (a connection over the cap, headers too slow, unparsable HTTP) are counted by
`connections.py` into the same counter. A client that leaves before any answer is counted nowhere.
"""

from __future__ import annotations

from telemetry.stats import FrontEndStats


class CountResponses:
    """ASGI middleware: `stats.record_response(status)` once per HTTP response started."""

    def __init__(self, app, stats: FrontEndStats):
        self.app = app
        self.stats = stats

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.stats.record_response(message["status"])
            await send(message)

        await self.app(scope, receive, send=counting_send)
