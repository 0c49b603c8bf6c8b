"""The FastAPI app: /generate, /v1/completions, /v1/chat/completions, /v1/models, /metrics, /health, and
what the SGLang router calls besides (server and model info, /get_load, /abort_request: `router_compat.py`).

Handlers never touch the scheduler: they submit to the `EngineLoop` and read the request's stream. A client
that disconnects (streaming or not) aborts its request, which frees its KV slots. Every error is answered
as `{"error": {"message", "type", "code"}}`:

| status | when |
|---|---|
| 400 | malformed JSON (too deep, huge integers, invalid Unicode), CL with TE, a request the engine can never serve |
| 400 | a body that breaks the schema, or an option the server does not support (named), as OpenAI answers |
| 401 | a missing or wrong API key on /v1/* or /generate (`--api-key`, `api_key.py`); a state-changing route without the right admin token (`admin.py`) |
| 403 | a Host or Origin this server does not answer (`site_guard.py`); an admin route with no token configured |
| 404 | an unknown model or route |
| 408 | headers or body too slow (`connections.py`, `body.py`) |
| 410 | the request was cancelled by an operator (`/abort_request`) |
| 413 | a body over `--max-request-bytes` |
| 415 | a POST without `Content-Type: application/json` |
| 429 | the waiting queue is full (`--max-queued-requests`); with Retry-After |
| 500 | the engine failed the request (or its process died under it) |
| 503 | draining (with Connection: close), the engine down or restarting, cut by shutdown, too many connections |
| 504 | the request ran past `--request-timeout` |

Checks run cheapest first, so that a hostile request costs little: site, content type and size before the
body is read, the queue before tokenizing, the prompt's length before the engine sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from runtime.core import RequestError
from runtime.server import chat, choices, openai_stream, protocol, router_compat
from runtime.server.admin import AdminToken
from runtime.server.api_key import APIKeyGuard
from runtime.server.body import read_body, require_json
from runtime.server.chat_template import ChatPrompt
from runtime.server.engine_loop import EngineLoop, EngineUnavailable, Overloaded, RequestStream, RequestTimedOut
from runtime.server.openai_options import OpenAIOptions
from runtime.server.openai_request import CompletionRequest
from runtime.server.options import ServerOptions
from runtime.server.prompt_bounds import encode_within
from runtime.server.protocol import APIError
from runtime.server.site_guard import SiteGuard, SitePolicy
from runtime.server.stops import TextDeltas
from telemetry.collector import process_registry
from telemetry.stats import FrontEndStats

# No token of the tokenizers served here is longer than this many characters (Gemma 3's longest vocabulary
# pieces are 31: runs of newlines, spaces or tabs; the byte tokenizer's is 1), so a text longer than this
# per context token cannot fit: it is rejected before the tokenizer spends time on it.
MAX_CHARS_PER_TOKEN = 64
OFF_LOOP_BYTES = 64 * 1024  # parse larger bodies and tokenize longer texts off the event loop
RETRY_AFTER_S = "1"
ENGINE_RETURN_WAIT_S = 30.0  # a new request waits this long for a restarting engine before its 503
MAX_ECHOED_CHARS = 64  # a client's value quoted back in an error is cut here (a 3 MB model name is not echoed)
TRACEPARENT_MAX_LEN = 55  # version-traceid-parentid-flags: 2 + 1 + 32 + 1 + 16 + 1 + 2


def create_app(engine_loop: EngineLoop, *, model_name: str, options: ServerOptions | None = None,
               openai: OpenAIOptions | None = None, chat_prompt: ChatPrompt | None = None,
               front_end_stats: FrontEndStats | None = None) -> FastAPI:
    """The app serving the engine behind `engine_loop` (a thread beside the event loop, or its own process)
    as `model_name` (or the first of `openai.served_model_names`). Its lifespan starts the engine (unless
    already started) and drains it on shutdown. `chat_prompt`: how chats become prompts (default: Gemma's
    turns). `front_end_stats`: the serving process's own counters (made here if not given; `app.state`
    keeps it)."""
    opts = options if options is not None else ServerOptions()
    api = openai if openai is not None else OpenAIOptions()
    model_names = api.served_model_names or (model_name,)
    model_name = model_names[0]
    tokenizer = engine_loop.tokenizer
    context_length = engine_loop.context_length
    stats = front_end_stats if front_end_stats is not None else FrontEndStats()
    stats.engine_up = lambda: engine_loop.alive
    # this process's CPU, memory, GC and its own series (engine up, restarts, HTTP answers); the engine's
    # counters come from the loop
    front_end = process_registry(stats)
    admin = AdminToken(opts.admin_token)
    created = int(time.time())
    if chat_prompt is None:
        chat_prompt = ChatPrompt.gemma(tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not engine_loop.started:
            engine_loop.start()
        yield
        await asyncio.to_thread(engine_loop.stop, opts.shutdown_timeout_s)

    docs = opts.enable_api_docs
    app = FastAPI(title="swa-runtime", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.state.engine_loop = engine_loop
    app.state.model_name = model_name
    app.state.front_end_stats = stats
    if opts.allowed_origins:  # answer the CORS preflights of the origins allowed (the guard refuses others)
        app.add_middleware(CORSMiddleware, allow_origins=list(opts.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Content-Type", "Authorization"])
    if api.api_key is not None:
        app.add_middleware(APIKeyGuard, api_key=api.api_key)
    app.add_middleware(SiteGuard, policy=SitePolicy(opts.host, opts.allowed_hosts, opts.allowed_origins))

    # ---- errors ------------------------------------------------------------------------------------------
    def error(status: int, message: str, type_: str, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(protocol.error_body(status, message, type_), status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error(exc.status, exc.message, exc.type, exc.headers)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error(400, str(exc), "invalid_request_error")

    @app.exception_handler(Overloaded)
    async def _overloaded(request: Request, exc: Overloaded) -> JSONResponse:
        return error(429, str(exc), "rate_limit_error", headers={"Retry-After": RETRY_AFTER_S})

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(request: Request, exc: EngineUnavailable) -> JSONResponse:
        return error(503, str(exc), "service_unavailable", headers=unavailable_headers())

    @app.exception_handler(RequestTimedOut)
    async def _timed_out(request: Request, exc: RequestTimedOut) -> JSONResponse:
        return error(504, str(exc), "timeout_error")

    def unavailable_headers() -> dict[str, str]:
        """Retry-After; while draining also Connection: close, so kept-alive clients move to another replica."""
        draining = engine_loop.alive and not engine_loop.accepting
        return {"Retry-After": "5", **({"Connection": "close"} if draining else {})}

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(400, "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()),
                     "invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = {404: f"no route {request.url.path}",
                   405: f"method {request.method} not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return error(exc.status_code, message, kind)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return error(500, f"internal error: {type(exc).__name__}", "internal_error")

    # ---- helpers -----------------------------------------------------------------------------------------
    async def parse(request: Request, model: type) -> Any:
        """The validated body; 415, 413, 408 or 400 otherwise (cheapest checks first)."""
        require_json(request)
        raw = await read_body(request, opts.max_request_bytes, opts.body_timeout_s)
        if len(raw) > OFF_LOOP_BYTES:
            return await anyio.to_thread.run_sync(_parse_validate, model, raw)
        return _parse_validate(model, raw)

    async def prompt_of(prompt: str | list[int], max_new_tokens: int) -> list[int]:
        """Token ids of a text or id-list prompt, refused early (counted `rejected`) when it cannot fit: a text
        longer than any tokenization could fit at once, a long one after bounded work (`prompt_bounds.py`)."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("empty prompt: give a non-empty `text` (or `input_ids`)")
            if len(prompt) > MAX_CHARS_PER_TOKEN * context_length:
                raise engine_loop.reject(
                    f"prompt text of {len(prompt)} characters cannot fit the context length of {context_length} "
                    f"tokens (at most {MAX_CHARS_PER_TOKEN * context_length} characters)")
            budget = context_length - max_new_tokens
            ids = (await anyio.to_thread.run_sync(encode_within, tokenizer, prompt, budget)
                   if len(prompt) > OFF_LOOP_BYTES else encode_within(tokenizer, prompt, budget))
            if ids is None:
                raise engine_loop.reject(f"prompt text of {len(prompt)} characters is longer than the "
                                         f"{budget} tokens that the context length of {context_length} leaves "
                                         f"beside max_new_tokens ({max_new_tokens})")
        else:
            ids = prompt
        if len(ids) + max_new_tokens > context_length:
            raise engine_loop.reject(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                                     f"the context length of {context_length} tokens")
        return ids

    async def collect(stream: RequestStream, request: Request) -> RequestStream:
        """The whole output; aborts the request if the client disconnects first."""
        async with stream:
            result = await _until_disconnect(stream.collect(), request)
        if result is None:  # client gone; nobody reads this response
            return stream
        failure = protocol.failure_of(stream.finish_reason, stream.message)
        if failure is not None:
            raise APIError(*failure)
        return stream

    async def collect_choices(streams: list[RequestStream], request: Request,
                              stops: tuple[str, ...]) -> list[choices.ChoiceResult]:
        """Every choice's whole output, cut at its first stop string (that request then ends at once);
        aborts them all if the client disconnects first."""
        try:
            result = await _until_disconnect(choices.collect_all(streams, tokenizer, stops), request)
        finally:
            choices.abort_all(streams)  # a no-op for those that finished
        return result if result is not None else [choices.ChoiceResult(finish_reason="abort") for _ in streams]

    async def admit() -> None:
        """Refuse now what `submit` would refuse, cheaply; but hold a request while a dead engine process is
        being replaced (up to `ENGINE_RETURN_WAIT_S`), so a restart costs clients a wait, not a 503."""
        await engine_loop.wait_until_restarted(ENGINE_RETURN_WAIT_S)
        engine_loop.check_admission()

    def check_model(model: str | None) -> None:
        if model is not None and model not in model_names:
            named = (repr(model) if len(model) <= MAX_ECHOED_CHARS
                     else f"{model[:MAX_ECHOED_CHARS]!r}... ({len(model)} characters)")
            raise APIError(404, f"model {named} not found; this server serves {model_name!r}", "not_found_error")

    # ---- routes ------------------------------------------------------------------------------------------
    live = router_compat.LiveRequests()  # by the ids clients gave, for /abort_request
    router_compat.add_routes(app, engine_loop=engine_loop, model_name=model_name, live=live,
                             body_timeout_s=opts.body_timeout_s, admin=admin)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await parse(request, protocol.GenerateRequest)
        check_model(body.model)
        client_rid = router_compat.client_request_id(request, body.rid)
        params = body.sampling_params.to_params()
        with live.opening(client_rid) as opening:
            await admit()
            prompt_ids = await prompt_of(body.input_ids if body.input_ids is not None else body.text,
                                         params.max_new_tokens)
            stream = await engine_loop.submit(prompt_ids, params, traceparent=traceparent_of(request),
                                              timeout_s=opts.request_timeout_s)
            rid = live.add([stream], opening)
        if body.stream:
            return SSEResponse(_generate_events(stream, tokenizer, rid), on_close=stream.abort)
        await collect(stream, request)
        return JSONResponse(protocol.generate_body(rid, tokenizer.decode(stream.output_ids), stream.output_ids,
                                                   stream.prompt_tokens, len(stream.output_ids), stream.finish_reason))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse(request, CompletionRequest)
        check_model(body.model)
        client_rid = router_compat.client_request_id(request, None)
        with live.opening(client_rid) as opening:
            await admit()
            max_new, n = body.max_new_tokens(), body.choices_per_prompt
            prompts = [await prompt_of(p, max_new) for p in body.prompts()]
            streams = await choices.submit_all(engine_loop, [(ids, body.to_params(max_new, j))
                                                             for ids in prompts for j in range(n)],
                                                traceparent=traceparent_of(request),
                                                timeout_s=opts.request_timeout_s)
            rid = live.add(streams, opening)
        now, stops, logprobs = int(time.time()), body.stop_strings(), body.logprobs is not None
        if body.streaming:
            return SSEResponse(openai_stream.completion_events(streams, tokenizer, rid, model_name, now, stops, n,
                                                               body.include_usage, logprobs),
                               on_close=lambda: choices.abort_all(streams))
        results = await collect_choices(streams, request, stops)
        body_choices = [protocol.completion_choice(
            i, r.text, r.finish_reason,
            choices.completion_logprobs(tokenizer, r.token_ids, r.logprobs) if logprobs else None)
            for i, r in enumerate(results)]
        return JSONResponse(protocol.completion_body(rid, now, model_name, body_choices,
                                                     openai_stream.request_usage(streams, n)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse(request, chat.ChatCompletionRequest)
        check_model(body.model)
        client_rid = router_compat.client_request_id(request, None)
        with live.opening(client_rid) as opening:
            await admit()
            asked = body.max_new_tokens()
            prompt_ids = await prompt_of(chat_prompt.render(body.messages), asked or 1)
            # without a limit: the server's default, never more than the context leaves
            max_new = asked or min(api.max_new_tokens_default, context_length - len(prompt_ids))
            n = body.choices_per_prompt
            streams = await choices.submit_all(engine_loop, [(prompt_ids, body.to_params(max_new, j))
                                                             for j in range(n)],
                                                traceparent=traceparent_of(request),
                                                timeout_s=opts.request_timeout_s)
            rid = live.add(streams, opening)
        now, stops, logprobs = int(time.time()), body.stop_strings(), body.logprobs is True
        if body.streaming:
            return SSEResponse(openai_stream.chat_events(streams, tokenizer, rid, model_name, now, stops,
                                                         body.include_usage, logprobs),
                               on_close=lambda: choices.abort_all(streams))
        results = await collect_choices(streams, request, stops)
        body_choices = [chat.chat_choice(i, r.text, r.finish_reason,
                                         choices.chat_logprobs(tokenizer, r.token_ids, r.logprobs) if logprobs
                                         else None)
                        for i, r in enumerate(results)]
        return JSONResponse(chat.chat_body(rid, now, model_name, body_choices,
                                           openai_stream.request_usage(streams, n)))

    @app.get("/v1/models")
    async def models() -> dict:
        return protocol.models_body(model_name, created, context_length)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await engine_loop.exposition() + generate_latest(front_end)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine_loop.accepting:
            running, waiting = engine_loop.queue_sizes()
            return JSONResponse({"status": "ok", "running": running, "waiting": waiting})
        why = "the server is shutting down" if engine_loop.alive else engine_loop.down_reason
        return error(503, why or engine_loop.DOWN_MESSAGE, "service_unavailable", headers=unavailable_headers())

    return app


def traceparent_of(request: Request) -> str | None:
    """The client's W3C `traceparent` header, for the engine's request span to continue its trace (with
    tracing on; ignored otherwise). A value longer than the format allows is dropped unread."""
    value = request.headers.get("traceparent")
    return value if value is not None and len(value) <= TRACEPARENT_MAX_LEN else None


def _parse_validate(model: type, raw: bytes) -> Any:
    return protocol.validate(model, protocol.parse_json(raw))


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


async def _sse_events(stream: RequestStream, tokenizer, body: Callable[[str, Any], dict]) -> AsyncIterator[bytes]:
    """SSE chunks of one request's stream; `body(text_delta, event)` shapes a chunk for its endpoint. A
    request the server ended (engine error, shutdown) sends its last tokens, then an error event."""
    text = TextDeltas(tokenizer)
    async with stream:
        async for ev in stream:
            failure = protocol.failure_of(ev.finish_reason, ev.message)
            if failure is None:
                yield protocol.sse(body(text.push(ev.token_ids, final=ev.finish_reason is not None), ev))
                continue
            if ev.token_ids:  # the error event that follows ends the stream, not a finish reason
                yield protocol.sse(body(text.push(ev.token_ids, final=True), replace(ev, finish_reason=None)))
            yield protocol.sse(protocol.error_body(*failure))
    yield protocol.SSE_DONE


def _generate_events(stream: RequestStream, tokenizer, rid: str) -> AsyncIterator[bytes]:
    return _sse_events(stream, tokenizer, lambda delta, ev: protocol.generate_body(
        rid, delta, list(ev.token_ids), stream.prompt_tokens, len(stream.output_ids), ev.finish_reason))


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
