"""A real uvicorn server on 127.0.0.1 (a free port) in a thread, serving a tiny engine; helpers to read it."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import torch
import uvicorn

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.models.config import Gemma3Config
from runtime.models.loader import build_model, random_state_dict
from runtime.models.tokenizer import ByteTokenizer
from runtime.server.app import create_app
from runtime.server.connections import uvicorn_config
from runtime.server.engine_loop import EngineLoop
from runtime.server.options import ServerOptions

WINDOW = 8  # Gemma3Config.tiny(): S S F S S F, window 8
CONTEXT = 1024


def lively_tiny_model():
    """The tiny config with its default random weights, whose greedy output depends on the context (see
    `random_state_dict`): a KV mix-up between requests would change the outputs."""
    config = Gemma3Config.tiny()
    return build_model(config, random_state_dict(config, seed=0), torch.float32)


def make_engine(**overrides) -> Engine:
    cfg = dict(model="tiny", max_total_tokens=4096, swa_full_tokens_ratio=0.25, max_running_requests=8,
               chunked_prefill_size=16, graph_batch_sizes=(1, 2, 4, 8))
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg), progress=False, model=lively_tiny_model(), tokenizer=ByteTokenizer())


@dataclass
class LiveServer:
    url: str
    engine: Engine
    engine_loop: EngineLoop
    server: uvicorn.Server
    thread: threading.Thread

    def wait_idle_clean(self, timeout_s: float = 10.0) -> None:
        """Wait until the scheduler has nothing queued or running (aborts travel asynchronously), then check
        on the engine thread that both pools are fully free, the mapping empty and no request row held."""
        sched = self.engine.scheduler
        deadline = time.monotonic() + timeout_s
        while self.engine_loop.call(sched.has_work).result(timeout_s):
            assert time.monotonic() < deadline, "requests still queued or running"
            time.sleep(0.02)
        self.engine_loop.call(sched.assert_idle_clean).result(timeout_s)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_server(engine: Engine, shutdown_timeout_s: float = 5.0, logger=None, openai=None, chat_prompt=None,
                 **options) -> LiveServer:
    """Serve `engine` on 127.0.0.1 (a free port) with `ServerOptions(**options)` (and `OpenAIOptions`
    `openai`, a `ChatPrompt`) and the server's own uvicorn config (connection limits and timeouts included);
    the engine loop logs to `logger` if given."""
    opts = ServerOptions(port=0, shutdown_timeout_s=shutdown_timeout_s, **options)
    engine_loop = EngineLoop(engine, max_queued_requests=opts.max_queued_requests, log_requests=opts.log_requests,
                             logger=logger)
    app = create_app(engine_loop, model_name="tiny", options=opts, openai=openai, chat_prompt=chat_prompt)
    server, thread, url = run_in_thread(uvicorn.Server(uvicorn_config(app, opts, log_level="warning")))
    return LiveServer(url, engine, engine_loop, server, thread)


def run_in_thread(server: uvicorn.Server) -> tuple[uvicorn.Server, threading.Thread, str]:
    """Start `server` (bound to port 0) in a daemon thread; returns it, the thread and its URL once it listens."""
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    return server, thread, f"http://{host}:{port}"


@pytest.fixture(scope="module")
def live():
    srv = start_server(make_engine())
    yield srv
    srv.stop()


@pytest.fixture
def client(live):
    with httpx.Client(base_url=live.url, timeout=60) as c:
        yield c


class RecordingLogger:
    """A structlog-like logger that keeps `(level, event, fields)` of every record."""

    def __init__(self):
        self.records: list[tuple[str, str, dict]] = []

    def __getattr__(self, level: str):
        return lambda event, **fields: self.records.append((level, event, fields))

    def events(self, name: str) -> list[dict]:
        return [fields for _, event, fields in self.records if event == name]


def sse_events(lines) -> list[dict | str]:
    """Parse an event stream strictly: every event is one `data: ...` line followed by a blank line."""
    events, pending = [], None
    for line in lines:
        if pending is None:
            assert line.startswith("data: "), f"not an SSE data line: {line!r}"
            pending = line[len("data: "):]
        else:
            assert line == "", f"an SSE event must end with a blank line, got {line!r}"
            events.append(pending if pending == "[DONE]" else json.loads(pending))
            pending = None
    assert pending is None, "stream ended inside an event"
    return events
