"""What the SGLang router (`sglang-router`, pinned in pyproject.toml) expects of a worker, served beside our API.

Learnt from the router's documentation and from its behaviour in front of this server (docs/fleet.md's
section sums it up for users); what each piece here answers:

- Registration: the router reads `GET /server_info` then `/model_info` (falling back to `/get_server_info`
  and `/get_model_info`). The model id it routes by is `served_model_name`. We give no `model_path` or
  `tokenizer_path`: the router would load a tokenizer from it (a Hugging Face download for a bare name),
  which its HTTP routing does not need.
- Health: `GET /health` every `--health-check-interval-secs`; 200 is healthy, anything else counts towards
  `--health-failure-threshold`. Ours answers 503 while draining, so a replica shutting down leaves the
  rotation without anyone telling the router.
- Load: `GET /get_load` answers a list with one entry per data-parallel rank; the router sums `num_tokens`
  (its `/get_loads` and the power-of-two policy read it).
- Request ids: the router forwards the client's `X-Request-Id` header and a `/generate` body's `rid`;
  responses report that id (`meta.id`, `cmpl-<id>`) and `/abort_request` takes it.
- Aborts: the router (0.3.2) has no `/abort_request` route; a client that leaves makes it drop the upstream
  connection, which this server treats like any disconnect: the request is aborted and its slots freed.
  `/abort_request` serves operators that talk to a replica directly, as SGLang's API does; it needs the
  admin token (`admin.py`), and the cancelled request's own client gets a 410 (streaming: an error event).
- Bodies: the router re-serialises `/generate` bodies through its own schema, adding its fields with their
  defaults (`ROUTER_GENERATE_FIELDS` in protocol.py); `/v1/completions` gets `echo`, `no_stop_trim`,
  `skip_special_tokens` and `return_hidden_states`, and its parser takes text prompts only.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client.parser import text_string_to_metric_families

from runtime.server import protocol
from runtime.server.admin import AdminToken
from runtime.server.body import read_body, require_json
from runtime.server.protocol import APIError
from telemetry import names

# Headers the router reads a request id from (its defaults), in the order it checks them.
REQUEST_ID_HEADERS = ("x-request-id", "x-correlation-id", "x-trace-id", "request-id")
MAX_ABORT_BODY_BYTES = 4096


def client_request_id(request: Request, body_rid: str | None) -> str | None:
    """The id the client gave this request: the body's `rid`, else the first request-id header; None if
    neither. Ids are echoed in responses, so they are bounded and printable."""
    rid = body_rid
    if rid is None:
        rid = next((request.headers[h] for h in REQUEST_ID_HEADERS if request.headers.get(h)), None)
    if rid is None:
        return None
    if len(rid) > protocol.MAX_RID_CHARS or not rid.isprintable():
        raise APIError(400, f"request id must be at most {protocol.MAX_RID_CHARS} printable characters")
    return rid


class Opening:
    """A request whose handler is still admitting and submitting it: no stream exists yet to cancel, so an
    abort meant for it is held here and applied once its streams do."""

    def __init__(self, client_id: str | None) -> None:
        self.client_id = client_id
        self.cancelled = False


class LiveRequests:
    """Requests in flight, found by the id their client gave (or, without one, by ours) for `/abort_request`.

    Holds the streams weakly: a request whose handler let go of it (finished, or its client left and it was
    aborted) disappears by itself. Several live requests may share a client id; an abort ends them all.
    A request counts from the moment its handler opens it (`opening`), not from the moment the engine accepted
    it: the engine may already be computing it before the handler hears back, and an abort in between must
    not be lost."""

    def __init__(self) -> None:
        self._ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # RequestStream -> client id
        self._opening: list[Opening] = []

    @contextmanager
    def opening(self, client_id: str | None) -> Iterator[Opening]:
        """Around a handler's admission and submission: aborts for `client_id` (or all) are remembered."""
        entry = Opening(client_id)
        self._opening.append(entry)
        try:
            yield entry
        finally:
            self._opening.remove(entry)

    def add(self, streams: list, opening: Opening) -> str:
        """Remember a request's streams (one per choice); returns the id responses report (the client's, else
        the first stream's). Cancels them at once if an abort came while the request was opening."""
        rid = opening.client_id if opening.client_id is not None else streams[0].rid
        for stream in streams:
            self._ids[stream] = rid
            if opening.cancelled:
                stream.abort("cancelled")
        return rid

    def abort(self, rid: str) -> None:
        """Cancel every unfinished request known by `rid` (cancelling one that just ended is a no-op)."""
        for entry in self._opening:
            entry.cancelled = entry.cancelled or entry.client_id == rid
        for stream, cid in list(self._ids.items()):
            if cid == rid or stream.rid == rid:
                stream.abort("cancelled")

    def abort_all(self) -> None:
        for entry in self._opening:
            entry.cancelled = True
        for stream in list(self._ids.keys()):
            stream.abort("cancelled")


def add_routes(app: FastAPI, *, engine_loop, model_name: str, live: LiveRequests, body_timeout_s: float,
               admin: AdminToken) -> None:
    """Mount the routes the router calls: server and model info, load, aborts (behind `admin`). `engine_loop`
    is what the app serves (an `EngineLoop` or `EngineProcess`: its queue sizes and metrics are read here)."""

    def server_info() -> dict:
        return {"served_model_name": model_name, "dp_size": 1, "context_length": engine_loop.context_length}

    def model_info() -> dict:
        return {"served_model_name": model_name, "is_generation": True, "model_type": "gemma3_text",
                "architectures": ["Gemma3ForCausalLM"], "max_model_len": engine_loop.context_length}

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server_info, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, model_info, methods=["GET"])

    @app.get("/get_load")
    async def get_load() -> list[dict]:
        running, waiting = engine_loop.queue_sizes()
        used = kv_tokens_used(await engine_loop.exposition())
        return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": used}]

    @app.post("/abort_request")
    async def abort_request(request: Request) -> JSONResponse:
        admin.require(request)
        require_json(request)
        raw = await read_body(request, MAX_ABORT_BODY_BYTES, body_timeout_s)
        body = protocol.validate(protocol.AbortRequest, protocol.parse_json(raw))
        if body.abort_all:
            live.abort_all()
        else:
            live.abort(body.rid)
        return JSONResponse({})  # as SGLang: an id that matches nothing (any more) is not an error


def kv_tokens_used(exposition: bytes) -> int:
    """Full-pool slots held by requests, read from the engine's metrics text (0 if it has none)."""
    for family in text_string_to_metric_families(exposition.decode()):
        if family.name == names.KV_TOKENS:
            for sample in family.samples:
                if sample.labels.get("pool") == "full" and sample.labels.get("state") == "used":
                    return int(sample.value)
    return 0
