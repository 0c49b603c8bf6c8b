"""The fleet's public port: a small front that lets clients reach the router's API routes and nothing else.

The SGLang router answers every Origin and Host (`Access-Control-Allow-Origin: *`) and serves its worker API
beside the API. So `swa-runtime fleet` binds the router to an internal loopback port and puts this front on
the public one. It applies `serve`'s Host and Origin policy (`runtime/server/site_guard.py`: a web page on
another site, or a DNS-rebinding name, gets 403) and forwards only the routes clients use (`PUBLIC_ROUTES`),
streaming the answers; the router's worker API and anything else get 404 here.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from runtime.server.body import read_body
from runtime.server.protocol import APIError, error_body
from runtime.server.site_guard import SiteGuard, SitePolicy

PUBLIC_ROUTES = {
    "/generate": "POST",
    "/v1/completions": "POST",
    "/v1/chat/completions": "POST",
    "/v1/models": "GET",
    "/health": "GET",
}
# Connection-level headers are the front's own business on each side (RFC 9110, section 7.6.1).
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
              "host", "content-length"}
MAX_BODY_BYTES = 4 * 1024 * 1024  # serve's default --max-request-bytes
BODY_TIMEOUT_S = 30.0


def create_front(router_url: str, policy: SitePolicy) -> Starlette:
    """The ASGI app of the public port, forwarding to the router at `router_url`."""
    client = httpx.AsyncClient(base_url=router_url, timeout=httpx.Timeout(None, connect=5.0))

    async def forward(request: Request) -> Response:
        path = request.url.path
        if PUBLIC_ROUTES.get(path) != request.method:
            return JSONResponse(error_body(404, f"no route {request.method} {path} on the fleet's public port",
                                           "not_found_error"), status_code=404)
        try:
            body = await read_body(request, MAX_BODY_BYTES, BODY_TIMEOUT_S)
        except APIError as exc:
            return JSONResponse(error_body(exc.status, exc.message, exc.type), status_code=exc.status,
                                headers=exc.headers)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        upstream = client.build_request(request.method, path, params=request.query_params, headers=headers,
                                        content=body)
        try:
            answer = await client.send(upstream, stream=True)
        except httpx.TransportError as exc:
            return JSONResponse(error_body(502, f"the router did not answer: {type(exc).__name__}",
                                           "service_unavailable"), status_code=502)
        kept = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(answer.aiter_raw(), status_code=answer.status_code, headers=kept,
                                 background=BackgroundTask(answer.aclose))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST", "PUT", "PATCH", "DELETE",
                                                                     "OPTIONS", "HEAD"])], lifespan=lifespan)
    app.add_middleware(SiteGuard, policy=policy)
    return app
