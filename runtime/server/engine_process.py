"""The engine in its own process: the HTTP front end never shares a GIL or a thread pool with it.

`EngineProcess` offers the front end the same interface as the in-process `EngineLoop` (submit, abort,
admission checks, shutdown, queue sizes, the metrics exposition). It spawns a child that builds the engine on
its main thread and runs the `EngineLoop` there, so every torch operation runs on the one thread that built
the engine (one OpenMP team). The two talk over a pipe:

    front end -> engine: ("add", rid, prompt_ids, params, traceparent) | ("abort", rid, reason) | ("finish", rid, reason)
                         | ("count", status, n) | ("call", token, what) | ("metrics", token) | ("ping", token)
                         | ("shutdown", timeout_s)
    engine -> front end: ("ready", info) | ("admitted", rid) | ("add_failed", rid, kind, message)
                         | ("tokens", [(rid, id, logprob or None), ...]) | ("final", rid, reason, message)
                         | ("queue", running, waiting)
                         | ("reply", token, ok, value)

Metrics are counted in the engine process and rendered there at scrape time, by its pipe reader (the engine
thread is never waited on). If the engine process dies, every live request ends with an error, `/health`
answers 503, and new requests are refused; nothing waits on it. The requests it took with it are counted
`error` by the next engine process (`restart()`), whose counters start from 0 like every series of a
restarted process. A step's tokens travel as one message, sent when the step ends: one write, one wake-up of the
front end's reader and event loop a step instead of one a running request (the front end shares the CPU with the
step's threads). Watching the heartbeat (`ping`) and deciding when to restart is `supervisor.py`'s job.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import multiprocessing
import signal
import threading
import time
from typing import Any

import structlog

from runtime.config import EngineConfig
from runtime.core import Req, RequestError, SamplingParams
from runtime.server.engine_loop import EngineUnavailable, Overloaded, RequestStream, _Final, wait_admitted

log = structlog.get_logger("swa_runtime.server")

READY_TIMEOUT_S = 900.0  # assembling and loading the default model on a slow machine
METRICS_WAIT_S = 2.0
CALLS = ("has_work", "assert_idle_clean")  # what the front end may ask the scheduler (tests, diagnostics)


class EngineProcess:
    DOWN_MESSAGE = "the engine process is not running"

    def __init__(self, cfg: EngineConfig, tokenizer, *, max_queued_requests: int = 256, log_requests: bool = False,
                 log_format: str = "console", log_level: str = "WARNING", instance: str | None = None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.max_queued_requests = max_queued_requests
        self._child_options = dict(max_queued_requests=max_queued_requests, log_requests=log_requests,
                                   log_format=log_format, log_level=log_level, instance=instance)
        self._ctx = multiprocessing.get_context("spawn")
        self._process = None
        self._conn = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # the tables below, shared by the event loop and the reader thread
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._adding: dict[str, concurrent.futures.Future] = {}
        self._replies: dict[int, concurrent.futures.Future] = {}
        self._tokens = itertools.count(1)
        self._ready = threading.Event()
        self._info: dict[str, Any] = {}
        self._running = self._waiting = 0
        self._accepting = True
        self._dead: str | None = None  # why the engine process is gone
        self._unresponsive: str | None = None  # why the supervisor thinks a live process cannot serve
        self._lost = 0  # requests a dead engine process took with it, to count on the next one
        self.restartable = False  # a supervisor will replace a dead process (it sets this; False once it gives up)
        self._reader: threading.Thread | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def start(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Spawn the engine process and wait until its engine is built (raises if it fails to start)."""
        self.launch()
        self.wait_started(timeout_s)

    def launch(self) -> None:
        """Spawn the engine process and return at once: the front end does its own set-up (its tokenizer) while the
        engine process builds, then calls `wait_started`."""
        if self._process is not None:
            raise RuntimeError("EngineProcess launched twice")
        self._spawn()

    def wait_started(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Wait until the launched engine process has built its engine (raises, and kills it, if it fails)."""
        self._wait_ready(timeout_s)

    def restart(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Replace the engine process by a fresh one (killing it first if it still runs) and wait until it is
        ready; the requests the old one took with it are counted `error` there. Raises if it fails to start."""
        if not self._accepting:
            raise RuntimeError("the server is shutting down: no restart")
        self.kill()
        if self._reader is not None:
            self._reader.join(10.0)  # it has ended every live request and counted them lost
        lost, self._lost = self._lost, 0
        self._spawn()
        try:
            self._wait_ready(timeout_s)
        except RuntimeError:
            self._lost += lost
            raise
        if lost:
            self._send(("count", "error", lost))

    def kill(self) -> None:
        """SIGKILL the engine process (hung or not) and wait for it; its pipe reader then ends its requests."""
        if self._process is not None and self._process.is_alive():
            self._process.kill()
            self._process.join(5.0)

    def _spawn(self) -> None:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_engine_main, args=(child, self.cfg, self._child_options),
                                    name="swa-runtime-engine", daemon=True)
        with _sigint_ignored_by_children():
            process.start()
        child.close()
        self._ready.clear()
        self._process, self._conn = process, parent
        self._dead = self._unresponsive = None
        self._running = self._waiting = 0
        self._reader = threading.Thread(target=self._read, args=(parent, process), name="swa-runtime-engine-pipe",
                                        daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.2):
            if self._dead is not None or time.monotonic() > deadline:
                why = self._dead or "timed out"
                self.kill()
                raise RuntimeError(f"the engine process failed to start: {why}")

    async def wait_until_restarted(self, timeout_s: float) -> None:
        """While a dead engine process is being replaced, wait (up to `timeout_s`) until the new one is ready;
        returns at once otherwise (alive, hung, shutting down, or nobody restarts it)."""
        deadline = time.monotonic() + timeout_s
        while (self._dead is not None or not self._ready.is_set()) and self.restartable and self._accepting \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def ping(self) -> concurrent.futures.Future:
        """A heartbeat: answered by the engine process's pipe reader with `{"busy_s": s}`, how long the
        engine step now running has run. No answer means the process is stopped or wedged."""
        return self._request(("ping", None))

    def mark_unresponsive(self, reason: str | None) -> None:
        """The supervisor's verdict on a live process: while `reason` is set it counts as down."""
        self._unresponsive = reason

    @property
    def started(self) -> bool:
        return self._process is not None

    @property
    def alive(self) -> bool:
        """Built, running and answering its heartbeat."""
        return self._ready.is_set() and self._dead is None and self._unresponsive is None

    @property
    def exited(self) -> bool:
        """The process has gone (died, was killed, or stopped at shutdown)."""
        return self._dead is not None

    @property
    def accepting(self) -> bool:
        return self._accepting and self.alive

    @property
    def stopping(self) -> bool:
        """A shutdown was asked for: an exit is expected and nothing restarts it."""
        return not self._accepting

    @property
    def down_reason(self) -> str | None:
        """Why the engine cannot serve, for /health (None while it can)."""
        if self._dead is not None:
            return f"{self.DOWN_MESSAGE}: {self._dead}"
        if self._unresponsive is not None:
            return self._unresponsive
        return None if self._ready.is_set() else "the engine process is starting"

    @property
    def context_length(self) -> int:
        return self._info["context_length"]

    @property
    def exitcode(self) -> int | None:
        return None if self._process is None else self._process.exitcode

    def begin_shutdown(self, timeout_s: float) -> None:
        """Stop admitting now; the engine drains for `timeout_s`, aborts the rest and exits. Returns at once."""
        self._accepting = False
        self._send(("shutdown", max(0.0, timeout_s)))

    def stop(self, timeout_s: float = 30.0) -> None:
        """Drain (see `begin_shutdown`) and wait for the engine process to exit; kill it if it does not."""
        self.begin_shutdown(timeout_s)
        if self._process is None:
            return
        self._process.join(timeout_s + 30.0)
        if self._process.is_alive():
            log.error("engine_process_did_not_stop", waited_s=timeout_s + 30.0)
            self._process.kill()
            self._process.join(5.0)

    # ---- event-loop side ---------------------------------------------------------------------------------
    def queue_sizes(self) -> tuple[int, int]:
        return self._running, self._waiting

    def backlog(self) -> int:
        with self._lock:
            pending = len(self._adding)
        return max(0, pending + self._waiting + self._running - self.cfg.max_running_requests)

    def check_admission(self) -> None:
        if not self.alive:
            raise EngineUnavailable(self.DOWN_MESSAGE)
        if not self._accepting:
            raise EngineUnavailable("the server is shutting down and accepts no new requests")
        if self.backlog() >= self.max_queued_requests:
            self.count("refused")
            raise Overloaded(f"the server is busy: {self.max_queued_requests} requests are already waiting "
                             "(--max-queued-requests); retry later")

    def count(self, status: str, n: int = 1) -> None:
        """Count requests that ended before reaching the scheduler (the engine process keeps every count)."""
        self._send(("count", status, n))

    def reject(self, message: str) -> RequestError:
        self.count("rejected")
        return RequestError(message)

    async def submit(self, prompt_ids: list[int], params: SamplingParams,
                     traceparent: str | None = None, timeout_s: float | None = None) -> RequestStream:
        """Queue a request; returns its stream once the scheduler accepted it (raises RequestError if not;
        RequestTimedOut if that takes longer than `timeout_s`, which also bounds the stream). `traceparent`
        travels to the engine process, where the spans are made."""
        self.check_admission()
        req = Req(list(prompt_ids), params)
        queue: asyncio.Queue = asyncio.Queue()
        admitted: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._streams[req.rid] = (asyncio.get_running_loop(), queue)
            self._adding[req.rid] = admitted
        if not self._send(("add", req.rid, req.prompt_ids, params, traceparent)):
            self._forget(req.rid)
            raise EngineUnavailable(self.DOWN_MESSAGE)
        try:
            await wait_admitted(admitted, timeout_s, lambda: self.abort(req.rid))
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                self._forget(req.rid)
            raise
        return RequestStream(self, req, queue, timeout_s)

    def abort(self, rid: str, reason: str = "abort") -> None:
        self._send(("abort", rid, reason))

    def finish(self, rid: str, reason: str = "stop") -> None:
        self._send(("finish", rid, reason))

    def call(self, what: str) -> concurrent.futures.Future:
        """Ask the engine thread `what` (one of CALLS) between steps; the future holds its answer."""
        if what not in CALLS:
            raise ValueError(f"unknown call {what!r}; one of {CALLS}")
        return self._request(("call", None, what))

    async def exposition(self) -> bytes:
        """The engine's metrics, rendered in the engine process at scrape time; nothing (at once) while the
        engine is down, and nothing after `METRICS_WAIT_S` (a scrape never waits on a wedged engine)."""
        if not self.alive:
            return b""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self._request(("metrics", None))), METRICS_WAIT_S)
        except (asyncio.TimeoutError, EngineUnavailable):
            return b""

    # ---- the pipe ----------------------------------------------------------------------------------------
    def _request(self, message: tuple) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        token = next(self._tokens)
        with self._lock:
            self._replies[token] = fut
        if not self._send((message[0], token, *message[2:])):
            with self._lock:
                self._replies.pop(token, None)
            fut.set_exception(EngineUnavailable(self.DOWN_MESSAGE))
        return fut

    def _send(self, message: tuple) -> bool:
        if self._conn is None or self._dead is not None:
            return False
        try:
            with self._send_lock:
                self._conn.send(message)
            return True
        except (OSError, EOFError, ValueError):
            return False

    def _read(self, conn, process) -> None:
        """The reader thread of one engine process: dispatch its messages until the pipe closes."""
        try:
            while True:
                self._dispatch(conn.recv())
        except (EOFError, OSError, ValueError):
            pass
        stopping = not self._accepting  # a shutdown was asked for: the pipe closes as the process exits
        process.join(5.0)
        code = process.exitcode
        expected = stopping and code in (0, None)
        self._running = self._waiting = 0
        self._dead = "it exited" if expected else f"it exited unexpectedly (exit code {code})"
        lost = self._end_all(_Final("abort" if expected else "error", f"the engine process stopped: {self._dead}"))
        if not expected:
            self._lost += lost
            if self._ready.is_set():
                log.error("engine_process_died", exitcode=code, lost_requests=lost)

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "tokens":
            self._deliver([(rid, item) for rid, token, logprob in message[1]
                           for item in ((token,) if logprob is None else (token, logprob))])
        elif kind == "final":
            _, rid, reason, text = message
            self._push(rid, _Final(reason, text))
            self._forget(rid)
        elif kind == "queue":
            self._running, self._waiting = message[1], message[2]
        elif kind == "admitted":
            self._settle(self._adding, message[1], None)
        elif kind == "add_failed":
            _, rid, exc_kind, text = message
            exc = RequestError(text) if exc_kind == "request" else EngineUnavailable(text)
            self._settle(self._adding, rid, exc)
            self._forget(rid)
        elif kind == "reply":
            _, token, ok, value = message
            self._settle(self._replies, token, None if ok else AssertionError(value), value)
        elif kind == "ready":
            self._info = message[1]
            self._ready.set()

    def _push(self, rid: str, item) -> None:
        self._deliver([(rid, item)])

    def _deliver(self, items: list[tuple[str, Any]]) -> None:
        """Hand (rid, item) pairs to their streams' queues, in order: one call into each event loop for them all."""
        with self._lock:
            targets = [(self._streams.get(rid), item) for rid, item in items]
        by_loop: dict[Any, list] = {}
        for target, item in targets:
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], item))
        for aloop, puts in by_loop.items():
            try:
                aloop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:  # the event loop is closed: nobody listens any more
                pass

    def _settle(self, table: dict, key, exc: BaseException | None, value: Any = None) -> None:
        with self._lock:
            fut = table.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_exception(exc) if exc is not None else fut.set_result(value)

    def _forget(self, rid: str) -> None:
        with self._lock:
            self._streams.pop(rid, None)
            self._adding.pop(rid, None)

    def _end_all(self, final: _Final) -> int:
        """End every live request with `final` and fail every pending answer; returns how many requests."""
        with self._lock:
            rids = list(self._streams)
            ended = len(set(rids) | set(self._adding))
            waiting = list(self._adding.values()) + list(self._replies.values())
            self._adding.clear()
            self._replies.clear()
        for rid in rids:
            self._push(rid, final)
            self._forget(rid)
        for fut in waiting:
            if not fut.done():
                fut.set_exception(EngineUnavailable(self.DOWN_MESSAGE))
        return ended


def _put_all(puts: list[tuple[asyncio.Queue, Any]]) -> None:
    """Runs on a stream's event loop: the items `_deliver` handed it, into their queues in order."""
    for queue, item in puts:
        queue.put_nowait(item)


# ---- the engine process -----------------------------------------------------------------------------------
@contextlib.contextmanager
def _sigint_ignored_by_children():
    """Spawn with SIGINT ignored, which the child inherits through exec: a Ctrl-C while it is still importing
    must not print its traceback (the front end decides when the engine stops; `_engine_main` keeps it so)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _engine_main(conn, cfg: EngineConfig, options: dict) -> None:
    """Entry point of the engine process: build the engine here, on the main thread, and run its loop."""
    # Ctrl-C reaches the whole process group: the front end decides when the engine stops (a shutdown
    # message), or the pipe closes when the front end is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from prometheus_client import generate_latest

    from runtime.engine import Engine
    from runtime.server.engine_loop import EngineLoop
    from telemetry.collector import make_registry
    from telemetry.logging import configure_logging

    configure_logging(options["log_format"], options["log_level"], instance=options["instance"])
    send_lock = threading.Lock()

    def send(message: tuple) -> None:
        try:
            with send_lock:
                conn.send(message)
        except (OSError, EOFError, ValueError):
            pass  # the front end is gone; the reader below notices and shuts the loop down

    engine = Engine(cfg, progress=True)
    loop = EngineLoop(engine, max_queued_requests=options["max_queued_requests"],
                      log_requests=options["log_requests"])
    registry = make_registry(engine.stats)
    queue_seen = [(-1, -1)]

    def report_queue() -> None:
        sizes = loop.queue_sizes()
        if sizes != queue_seen[0]:
            queue_seen[0] = sizes
            send(("queue", *sizes))

    step_tokens: list[tuple] = []  # (rid, id, logprob or None) of the step under way; engine thread only

    def send_tokens() -> None:
        """The tokens the step gave, in one message (the loop calls it after each step)."""
        if step_tokens:
            send(("tokens", step_tokens[:]))
            step_tokens.clear()
            report_queue()

    def add(rid: str, prompt_ids: list[int], params: SamplingParams, traceparent: str | None) -> None:
        def on_token(r: Req, t: int) -> None:
            step_tokens.append((r.rid, t, r.output_logprobs[-1] if r.params.logprobs is not None else None))

        def on_finish(r: Req) -> None:
            send_tokens()  # a request's tokens before its end
            final = loop.final_of(r)
            send(("final", r.rid, final.reason, final.message))
            report_queue()

        req = Req(prompt_ids, params, rid=rid, on_token=on_token, on_finish=on_finish, traceparent=traceparent)
        try:
            admitted = loop.post_add(req)
        except EngineUnavailable as exc:
            send(("add_failed", rid, "unavailable", str(exc)))
            return

        def settled(fut: concurrent.futures.Future) -> None:
            exc = fut.exception()
            if exc is None:
                send(("admitted", rid))
            else:
                send(("add_failed", rid, "request" if isinstance(exc, RequestError) else "unavailable", str(exc)))
            report_queue()

        admitted.add_done_callback(settled)

    def answer(token: int, what: str) -> None:
        fn = getattr(engine.scheduler, what)

        def done(fut: concurrent.futures.Future) -> None:
            exc = fut.exception()
            send(("reply", token, exc is None, fut.result() if exc is None else f"{type(exc).__name__}: {exc}"))

        try:
            loop.call(fn).add_done_callback(done)
        except EngineUnavailable as exc:
            send(("reply", token, False, str(exc)))

    def read() -> None:
        """The pipe reader: hands requests to the loop and renders metrics itself (never waits on a step)."""
        try:
            while True:
                message = conn.recv()
                kind = message[0]
                if kind == "add":
                    add(*message[1:])
                elif kind == "abort":
                    loop.abort(message[1], message[2])
                elif kind == "finish":
                    loop.finish(message[1], message[2])
                elif kind == "count":
                    loop.count(message[1], message[2])
                elif kind == "ping":
                    send(("reply", message[1], True, {"busy_s": loop.busy_s()}))
                elif kind == "metrics":
                    send(("reply", message[1], True, generate_latest(registry)))
                elif kind == "call" and message[2] in CALLS:
                    answer(message[1], message[2])
                elif kind == "shutdown":
                    loop.begin_shutdown(message[1])
        except (EOFError, OSError, ValueError):
            loop.begin_shutdown(0.0)  # the front end is gone: nobody can read the answers

    def started() -> None:  # the loop accepts posts from here on: only now may requests arrive
        threading.Thread(target=read, name="swa-runtime-engine-pipe", daemon=True).start()
        send(("ready", {"context_length": engine.context_length}))

    loop.run_in_this_thread(on_started=started, after_step=send_tokens)
    send(("queue", 0, 0))  # the process exits now; the pipe closes with it
