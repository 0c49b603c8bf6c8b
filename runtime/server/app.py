"""The FastAPI app: /generate, /v1/completions, /v1/models, /metrics, /health.

Handlers never touch the scheduler: they submit to the `EngineLoop` and read the request's stream. A client
that disconnects (streaming or not) aborts its request, which frees its KV slots. Every error is answered
as `{"error": {"message", "type", "code"}}`: 400 malformed JSON or a request the engine can never serve,
422 a body that breaks the schema, 404 an unknown model or route, 503 while draining or after the engine
thread stopped, 500 an engine failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.core import RequestError
from runtime.server import protocol
from runtime.server.engine_loop import EngineLoop, EngineUnavailable, RequestStream
from runtime.server.protocol import APIError
from telemetry.collector import make_registry


def create_app(engine_loop: EngineLoop, *, model_name: str, shutdown_timeout_s: float = 30.0) -> FastAPI:
    """The app serving `engine_loop.engine` as `model_name`. Its lifespan starts the engine thread (unless
    already started) and drains it on shutdown."""
    engine = engine_loop.engine
    tokenizer = engine.tokenizer
    registry = make_registry(engine.stats, process_collectors=True)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not engine_loop.started:
            engine_loop.start()
        yield
        await asyncio.to_thread(engine_loop.stop, shutdown_timeout_s)

    app = FastAPI(title="swa-runtime", lifespan=lifespan)
    app.state.engine_loop = engine_loop

    # ---- errors ------------------------------------------------------------------------------------------
    def error(status: int, message: str, type_: str, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(protocol.error_body(status, message, type_), status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error(exc.status, exc.message, exc.type)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error(400, str(exc), "invalid_request_error")

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(request: Request, exc: EngineUnavailable) -> JSONResponse:
        return error(503, str(exc), "service_unavailable", headers={"Retry-After": "5"})

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(422, "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()),
                     "invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = {404: f"no route {request.url.path}",
                   405: f"method {request.method} not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return error(exc.status_code, message, kind)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return error(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")

    # ---- helpers -----------------------------------------------------------------------------------------
    def encode(text: str) -> list[int]:
        if not text:
            raise RequestError("empty prompt: give a non-empty `text` (or `input_ids`)")
        return tokenizer.encode(text)

    async def collect(stream: RequestStream, request: Request) -> RequestStream:
        """The whole output; aborts the request if the client disconnects first."""
        async with stream:
            result = await _until_disconnect(stream.collect(), request)
        if result is None:  # client gone; nobody reads this response
            return stream
        if stream.finish_reason == "error":
            raise APIError(500, stream.message or "engine error", "internal_error")
        return stream

    # ---- routes ------------------------------------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = protocol.validate(protocol.GenerateRequest, protocol.parse_json(await request.body()))
        prompt_ids = body.input_ids if body.input_ids is not None else encode(body.text)
        stream = await engine_loop.submit(prompt_ids, body.sampling_params.to_params())
        if body.stream:
            return SSEResponse(_generate_events(stream, tokenizer), on_close=stream.abort)
        await collect(stream, request)
        return JSONResponse(protocol.generate_body(stream.rid, tokenizer.decode(stream.output_ids), stream.output_ids,
                                                   stream.prompt_tokens, len(stream.output_ids), stream.finish_reason))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = protocol.validate(protocol.CompletionRequest, protocol.parse_json(await request.body()))
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"model {body.model!r} not found; this server serves {model_name!r}",
                           "not_found_error")
        prompt_ids = body.prompt if isinstance(body.prompt, list) else encode(body.prompt)
        stream = await engine_loop.submit(prompt_ids, body.to_params())
        now = int(time.time())
        if body.stream:
            return SSEResponse(_completion_events(stream, tokenizer, model_name, now), on_close=stream.abort)
        await collect(stream, request)
        return JSONResponse(protocol.completion_body(
            stream.rid, now, model_name, tokenizer.decode(stream.output_ids), stream.finish_reason,
            (stream.prompt_tokens, len(stream.output_ids))))

    @app.get("/v1/models")
    async def models() -> dict:
        return protocol.models_body(model_name, created, engine.runner.context_length)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine_loop.accepting:
            sched = engine.scheduler
            return JSONResponse({"status": "ok", "running": sched.num_running(), "waiting": sched.num_waiting()})
        why = "the server is shutting down" if engine_loop.alive else "the engine thread is not running"
        return error(503, why, "service_unavailable")

    return app


# ---- streaming -------------------------------------------------------------------------------------------


class SSEResponse(StreamingResponse):
    """An event stream that always watches for the client leaving (whatever the ASGI spec version), and
    always closes its body iterator and calls `on_close` (abort the request; a no-op once it finished), even
    when the client left before the first chunk."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream_then_stop() -> None:
                    with contextlib.suppress(OSError):  # the client left during a send
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self._on_close()
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


class TextDeltas:
    """Incremental detokenization: the text each new batch of tokens adds. Held back while the decoded text
    ends in U+FFFD (an unfinished multi-byte character); `final=True` flushes whatever is left. Decodes a
    short window (from the last emitted boundary), so that a long completion costs linear, not quadratic,
    work; the concatenated deltas equal `decode(all ids)` as long as the decoder is prefix-stable at
    boundaries where the text was complete."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids already turned into text

    def push(self, ids: tuple[int, ...], final: bool = False) -> str:
        self._ids.extend(ids)
        before = self._tok.decode(self._ids[self._prefix:self._read])
        after = self._tok.decode(self._ids[self._prefix:])
        if not final and (after.endswith("\ufffd") or len(after) <= len(before)):
            return ""
        delta = after[len(before):] if after.startswith(before) else after
        self._prefix, self._read = self._read, len(self._ids)
        return delta


async def _sse_events(stream: RequestStream, tokenizer, body: Callable[[str, Any], dict]) -> AsyncIterator[bytes]:
    """SSE chunks of one request's stream; `body(text_delta, event)` shapes a chunk for its endpoint."""
    text = TextDeltas(tokenizer)
    async with stream:
        async for ev in stream:
            if ev.finish_reason == "error":
                yield protocol.sse(protocol.error_body(500, ev.message or "engine error", "internal_error"))
                break
            yield protocol.sse(body(text.push(ev.token_ids, final=ev.finish_reason is not None), ev))
    yield protocol.SSE_DONE


def _generate_events(stream: RequestStream, tokenizer) -> AsyncIterator[bytes]:
    return _sse_events(stream, tokenizer, lambda delta, ev: protocol.generate_body(
        stream.rid, delta, list(ev.token_ids), stream.prompt_tokens, len(stream.output_ids), ev.finish_reason))


def _completion_events(stream: RequestStream, tokenizer, model: str, created: int) -> AsyncIterator[bytes]:
    def body(delta: str, ev) -> dict:
        usage = (stream.prompt_tokens, len(stream.output_ids)) if ev.finish_reason is not None else None
        return protocol.completion_body(stream.rid, created, model, delta, ev.finish_reason, usage)

    return _sse_events(stream, tokenizer, body)


async def _until_disconnect(work: Awaitable, request: Request):
    """`await work`, or None if the client disconnects first (the work is then cancelled)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task in done else None
