"""The engine thread: steps the scheduler beside the asyncio event loop.

The scheduler is not thread-safe, so only this thread touches it. The event loop talks to it through an
inbox (add, abort, call) and hears back through per-request asyncio queues that the scheduler's callbacks
feed with `loop.call_soon_threadsafe`. The thread sleeps on an Event while there is nothing to do.

Contracts:
- `submit()` returns once the scheduler accepted the request; input it can never serve raises
  `RequestError` (a 4xx, counted `rejected`), a full waiting queue raises `Overloaded` (a 429, counted
  `refused`), a draining or dead engine raises `EngineUnavailable` (a 503).
- Every admitted request ends with exactly one final event: finish reason `length`, `stop`, `abort` or
  `error`, and its slots are freed (the scheduler's abort frees them and counts the status we give it).
- An exception in `step()` is logged (rate-limited, without local variables or request contents); the
  requests it may have touched (the running batch) end with reason and status `error`; the thread keeps
  serving.
- Shutdown: stop admitting, let requests finish until a deadline, abort the rest (status `aborted`, with a
  message that tells the client why), then the thread exits.
- Request contents (prompt and output token ids) reach the logs only with `log_requests=True`.
- Only this thread changes `engine.stats`: counts decided on the event loop (refused, rejected early) are
  posted here, so two threads never increment the same counter.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from prometheus_client import generate_latest

from runtime.core import Req, RequestError, SamplingParams, TokenLogprob
from telemetry import names
from telemetry.collector import make_registry
from telemetry.ratelimit import RateLimiter

log = structlog.get_logger("swa_runtime.server")

SHUTDOWN_MESSAGE = "the server shut down before the request finished"
STEP_FAILED_EVENT = names.ENGINE_STEP_FAILED_EVENT


class EngineUnavailable(RuntimeError):
    """The engine is draining for shutdown or its thread has stopped: answer 503."""


class Overloaded(RuntimeError):
    """Too many requests wait for a place in the running batch: answer 429 and ask to retry later."""


class RequestTimedOut(RuntimeError):
    """The request was not accepted within its deadline (`--request-timeout`): answer 504."""


def timeout_message(timeout_s: float) -> str:
    return f"the request did not finish within {timeout_s:g} s (--request-timeout); it was aborted"


@dataclass(frozen=True)
class StreamEvent:
    """New tokens since the previous event; the last event of a request carries its finish reason."""

    token_ids: tuple[int, ...]
    finish_reason: str | None = None  # length | stop | abort | cancelled | timeout | error
    message: str | None = None  # why, for abort (shutdown) and error
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when the request asked for them


@dataclass(frozen=True)
class _Final:
    reason: str
    message: str | None


class RequestStream:
    """The tokens of one admitted request. Iterate once; `abort()` (or leaving the `async with` block
    before the end) frees the request's slots on the engine thread. With `timeout_s`, a request still
    running that long after it was accepted is aborted and ends with finish reason `timeout` (even if the
    engine never answers again)."""

    def __init__(self, engine_loop: "EngineLoop", req: Req, queue: asyncio.Queue, timeout_s: float | None = None):
        self._engine_loop = engine_loop
        self._req = req
        self._queue = queue
        self._timeout_s = timeout_s
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._timer: asyncio.TimerHandle | None = None  # the deadline, armed at the first wait
        self.output_ids: list[int] = []
        self.output_logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.message: str | None = None

    @property
    def rid(self) -> str:
        return self._req.rid

    @property
    def prompt_tokens(self) -> int:
        return len(self._req.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    async def __aiter__(self) -> AsyncIterator[StreamEvent]:
        """Yields as soon as tokens arrive, coalescing whatever queued up while the consumer was busy."""
        while not self.finished:
            items = [await self._next()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            tokens = tuple(t for t in items if isinstance(t, int))
            logprobs = tuple(t for t in items if isinstance(t, TokenLogprob))
            self.output_ids.extend(tokens)
            self.output_logprobs.extend(logprobs)
            final = next((f for f in items if isinstance(f, _Final)), None)
            if final is not None:
                self.finish_reason, self.message = final.reason, final.message
                self._disarm()
            yield StreamEvent(tokens, self.finish_reason, self.message, logprobs)

    async def _next(self) -> int | _Final:
        # One timer for the whole request, not a `wait_for` per token: that costs a task and a timer handle
        # each time, on the event loop that shares the CPU with the engine.
        if self._deadline is not None and self._timer is None:
            delay = max(0.0, self._deadline - time.monotonic())
            self._timer = asyncio.get_running_loop().call_later(delay, self._time_out)
        return await self._queue.get()

    def _time_out(self) -> None:
        """The deadline passed with the request unfinished: abort it; the stream ends with `timeout`, after
        whatever tokens had already arrived."""
        if not self.finished:
            self._engine_loop.abort(self.rid)
            self._queue.put_nowait(_Final("timeout", timeout_message(self._timeout_s)))

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def collect(self) -> "RequestStream":
        async for _ in self:
            pass
        return self

    def abort(self, reason: str = "abort") -> None:
        self._disarm()
        if not self.finished:
            self._engine_loop.abort(self.rid, reason)

    def finish(self, reason: str = "stop") -> None:
        """End the request now as finished (e.g. the front end saw a stop string): counted `finished`,
        its slots freed, its KV kept for the prefix cache like any finished request's."""
        if not self.finished:
            self._engine_loop.finish(self.rid, reason)

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.abort()


class EngineLoop:
    DOWN_MESSAGE = "the engine thread is not running"
    def __init__(self, engine, *, max_queued_requests: int = 256, log_requests: bool = False,
                 failure_log_interval_s: float = 60.0, logger: Any = None):
        """`max_queued_requests`: how many requests may wait beyond the running batch's free places before
        `submit()` refuses more. `failure_log_interval_s`: at most one step-failure record per interval
        (repeats are counted as suppressed). `logger`: a structlog-like logger (default: this module's)."""
        self.engine = engine
        self._log = logger if logger is not None else log
        self.scheduler = engine.scheduler
        self.max_queued_requests = max_queued_requests
        self.log_requests = log_requests
        self._max_running = engine.cfg.max_running_requests
        self._pending_adds = 0  # posted, not yet handed to the scheduler (under _lock)
        self._inbox: deque[tuple] = deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # orders posting against the thread's final close
        self._closed = False
        self._accepting = True
        self._deadline: float | None = None  # monotonic; set by begin_shutdown
        self._thread: threading.Thread | None = None
        # engine thread only:
        self._live: dict[str, Req] = {}  # admitted, not yet finished
        self._notes: dict[str, _Final] = {}  # how a request we end ourselves should be reported
        self._step_failures = 0
        self._failure_limiter = RateLimiter(interval_s=failure_log_interval_s)
        self._failures_suppressed = 0
        self._registry = None  # built on the first scrape
        self._step_started: float | None = None
        self._after_step: Callable[[], None] = lambda: None

    # ---- what the front end reads ------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    def queue_sizes(self) -> tuple[int, int]:
        """(running, waiting), read without the engine thread's cooperation."""
        return self.scheduler.num_running(), self.scheduler.num_waiting()

    async def exposition(self) -> bytes:
        """The engine's metrics in the Prometheus text format (read at scrape time from plain counters)."""
        if self._registry is None:
            self._registry = make_registry(self.engine.stats)
        return generate_latest(self._registry)

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("EngineLoop.start() called twice")
        self._thread = threading.Thread(target=self._run, name="swa-runtime-engine", daemon=True)
        self._thread.start()

    def run_in_this_thread(self, on_started: Callable[[], None] = lambda: None,
                           after_step: Callable[[], None] = lambda: None) -> None:
        """Run the loop on the calling thread until shutdown (the engine process's main thread, which also
        built the engine: all torch work stays on one thread). `on_started` runs once posts are accepted;
        `after_step` after each step, on this thread (the engine process sends the step's tokens then)."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already running")
        self._thread = threading.current_thread()
        self._after_step = after_step
        on_started()
        self._run()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        return self._accepting and self.alive

    @property
    def down_reason(self) -> str | None:
        """Why the engine cannot serve (None while it can)."""
        return None if self.alive else self.DOWN_MESSAGE

    async def wait_until_restarted(self, timeout_s: float) -> None:
        """Nothing restarts an engine thread: returns at once (see `EngineProcess`)."""

    def busy_s(self) -> float:
        """How long the step now running has run (0 between steps): a heartbeat reports it, so a step that
        never returns reads as a hung engine."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def begin_shutdown(self, timeout_s: float) -> None:
        """Stop admitting now; requests still running after `timeout_s` are aborted. Returns at once."""
        with self._lock:
            self._accepting = False
            deadline = time.monotonic() + max(0.0, timeout_s)
            self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)
        self._wake.set()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Drain (see `begin_shutdown`) and wait for the thread to exit (it is a daemon: a step that never
        returns cannot keep the process alive)."""
        self.begin_shutdown(timeout_s)
        if self._thread is not None:
            self._thread.join(timeout_s + 30.0)
            if self._thread.is_alive():
                self._log.error("engine_thread_did_not_stop", waited_s=timeout_s + 30.0)

    # ---- event-loop side ---------------------------------------------------------------------------------
    def check_admission(self) -> None:
        """Raise what `submit()` would raise before looking at the request: EngineUnavailable or Overloaded
        (counted `refused`). Cheap; call it before expensive work such as tokenizing."""
        if not self.alive:
            raise EngineUnavailable(self.DOWN_MESSAGE)
        if not self._accepting:
            raise EngineUnavailable("the server is shutting down and accepts no new requests")
        if self.backlog() >= self.max_queued_requests:
            self.count("refused")
            raise Overloaded(f"the server is busy: {self.max_queued_requests} requests are already waiting "
                             "(--max-queued-requests); retry later")

    def backlog(self) -> int:
        """Requests that wait for a place in the running batch, counting those still in the inbox (read
        without the engine thread's cooperation: exact up to requests it is moving at this instant)."""
        running, waiting = self.scheduler.num_running(), self.scheduler.num_waiting()
        return max(0, self._pending_adds + waiting + running - self._max_running)

    def count(self, status: str, n: int = 1) -> None:
        """Count `n` requests that ended before reaching the scheduler (on the engine thread, see above)."""
        stats = self.engine.stats

        def record() -> None:
            for _ in range(n):
                stats.record_request(status)

        try:
            self._post(("call", record, concurrent.futures.Future()))
        except EngineUnavailable:
            pass  # the thread has ended; so has counting

    def reject(self, message: str) -> RequestError:
        """A request refused before admission for what the scheduler would also refuse: counted `rejected`."""
        self.count("rejected")
        return RequestError(message)

    async def submit(self, prompt_ids: list[int], params: SamplingParams,
                     traceparent: str | None = None, timeout_s: float | None = None) -> RequestStream:
        """Queue a request; returns its stream once the scheduler accepted it (raises RequestError if not;
        RequestTimedOut if that takes longer than `timeout_s`, which also bounds the stream). `traceparent`:
        the client's W3C trace context, continued by the request's span when tracing is on."""
        self.check_admission()
        aloop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def push(item: int | _Final) -> None:
            try:
                aloop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is closed: nobody listens any more
                pass

        def on_token(r: Req, t: int) -> None:
            push(t)
            if r.params.logprobs is not None:
                push(r.output_logprobs[-1])

        req = Req(list(prompt_ids), params, on_token=on_token,
                  on_finish=lambda r: push(self.final_of(r)), traceparent=traceparent)
        admitted = self.post_add(req)
        await wait_admitted(admitted, timeout_s, lambda: self.abort(req.rid))
        return RequestStream(self, req, queue, timeout_s)

    def post_add(self, req: Req) -> concurrent.futures.Future:
        """Hand `req` to the engine thread; the future resolves when the scheduler accepted it (or raises
        what refused it). Its `on_finish` must report `final_of(req)`."""
        admitted: concurrent.futures.Future = concurrent.futures.Future()
        self._post(("add", req, admitted), adding=True)
        return admitted

    def abort(self, rid: str, reason: str = "abort") -> None:
        """End `rid` now (counted `aborted`); its client sees `reason` (`abort`: it left; `cancelled`: an
        operator's /abort_request)."""
        try:
            self._post(("abort", rid, reason))
        except EngineUnavailable:
            pass  # the thread has ended, and it aborted everything on its way out

    def finish(self, rid: str, reason: str = "stop") -> None:
        """End a request as finished with `reason` before its token budget (see `RequestStream.finish`)."""
        try:
            self._post(("finish", rid, reason))
        except EngineUnavailable:
            pass

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the engine thread between steps (e.g. `scheduler.assert_idle_clean`)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._post(("call", fn, fut))
        return fut

    def _post(self, item: tuple, adding: bool = False) -> None:
        with self._lock:
            if self._closed or self._thread is None:
                raise EngineUnavailable(self.DOWN_MESSAGE)
            self._inbox.append(item)
            if adding:
                self._pending_adds += 1
        self._wake.set()

    # ---- engine thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                self._drain_inbox()
                if self._deadline is not None:
                    if not self.scheduler.has_work():
                        break
                    if time.monotonic() >= self._deadline:
                        self._end_all(_Final("abort", SHUTDOWN_MESSAGE), "aborted")
                        break
                if self.scheduler.has_work():
                    if not self._step():
                        self._wake.wait(0.01)  # nothing could run this time; do not spin
                else:
                    self._wake.wait()
        except BaseException as exc:
            self._log.error("engine_thread_crashed", error=_describe(exc), where=_where(exc))
            raise
        finally:
            self._close()

    def _drain_inbox(self) -> None:
        while self._inbox:
            item = self._inbox.popleft()
            kind = item[0]
            if kind == "add":
                self._add(item[1], item[2])
                with self._lock:
                    self._pending_adds -= 1
            elif kind == "abort":
                self._abort(item[1], reason=item[2])
            elif kind == "finish":
                self._abort(item[1], status="finished", reason=item[2])
            else:
                _, fn, fut = item
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)

    def _add(self, req: Req, admitted: concurrent.futures.Future) -> None:
        try:
            self.scheduler.add(req)
        except RequestError as exc:
            admitted.set_exception(exc)
            return
        except Exception as exc:  # noqa: BLE001 - a bug in validation must not kill the thread
            self._log.error("engine_add_failed", rid=req.rid, error=_describe(exc), where=_where(exc))
            admitted.set_exception(exc)
            return
        self._live[req.rid] = req
        if self.log_requests:
            self._log.info("request_admitted", rid=req.rid, prompt_ids=req.prompt_ids, params=vars(req.params))
        admitted.set_result(None)

    def _abort(self, rid: str, status: str = "aborted", reason: str = "abort") -> None:
        try:
            self.scheduler.abort(rid, status=status, reason=reason)
        except Exception as exc:  # noqa: BLE001
            self._log.error("engine_abort_failed", rid=rid, error=_describe(exc), where=_where(exc))

    def _step(self) -> bool:
        self._step_started = time.monotonic()
        try:
            progressed = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - log, fail what it touched, keep serving
            self._step_failures += 1
            running = [r for r in self._live.values() if r.status == "running"]
            self._log_step_failure(exc, running)
            final = _Final("error", f"internal error in the engine step: {_describe(exc)}")
            # A second failure in a row with nothing running means admission itself fails: end everything.
            if running and self._step_failures == 1:
                self._end(running, final, "error")
            else:
                self._end_all(final, "error")
            return True
        finally:
            self._step_started = None
            self._after_step()
        self._step_failures = 0
        return progressed

    def _log_step_failure(self, exc: Exception, running: list[Req]) -> None:
        if not self._failure_limiter.allow(STEP_FAILED_EVENT):
            self._failures_suppressed += 1
            self.engine.stats.log_suppressed(STEP_FAILED_EVENT)
            return
        fields = {"error": _describe(exc), "where": _where(exc), "running": len(running),
                  "waiting": self.scheduler.num_waiting(), "consecutive": self._step_failures,
                  "suppressed_since_last": self._failures_suppressed}
        if self.log_requests:
            fields["requests"] = [{"rid": r.rid, "prompt_ids": r.prompt_ids, "output_ids": r.output_ids}
                                  for r in running]
        self._failures_suppressed = 0
        self._log.error(STEP_FAILED_EVENT, **fields)

    def _end_all(self, final: _Final, status: str) -> None:
        self._end(list(self._live.values()), final, status)

    def _end(self, reqs: list[Req], final: _Final, status: str) -> None:
        for r in reqs:
            self._notes[r.rid] = final
            try:
                # frees the slots, counts `status` and calls on_finish, which reads the note
                self.scheduler.abort(r.rid, status=status, reason=final.reason, message=final.message)
            except Exception as exc:  # noqa: BLE001 - the scheduler is in a bad state; still answer the client
                self._log.error("engine_abort_failed", rid=r.rid, error=_describe(exc), where=_where(exc))
            if r.rid in self._live:  # the scheduler did not call on_finish: do it ourselves
                r.status, r.finish_reason = status, final.reason
                if r.on_finish is not None:
                    r.on_finish(r)
            self._notes.pop(r.rid, None)

    def final_of(self, r: Req) -> _Final:
        """Called from on_finish on the engine thread: forget the request and say how it ended."""
        self._live.pop(r.rid, None)
        note = self._notes.pop(r.rid, None)
        final = note if note is not None else _Final(r.finish_reason or "abort", r.error)
        if self.log_requests:
            self._log.info("request_finished", rid=r.rid, status=r.status, finish_reason=final.reason,
                     output_ids=r.output_ids)
        return final

    def _close(self) -> None:
        """Refuse further posts; answer what is still in the inbox; end what is still live; flush the logs."""
        with self._lock:
            self._closed = True
            self._accepting = False
            left = list(self._inbox)
            self._inbox.clear()
        for item in left:
            if item[0] in ("add", "call"):
                item[-1].set_exception(EngineUnavailable("the engine thread stopped"))
        if self._live:
            try:
                self._end_all(_Final("abort", SHUTDOWN_MESSAGE), "aborted")
            except Exception as exc:  # noqa: BLE001
                self._log.error("engine_close_failed", error=_describe(exc), where=_where(exc))
        self.engine.close()


async def wait_admitted(admitted: concurrent.futures.Future, timeout_s: float | None,
                        abort: Callable[[], None]) -> None:
    """Wait until the scheduler accepted a request; `abort()` it if the client leaves or `timeout_s` passes
    first (the add may still land: the abort follows it), raising CancelledError or RequestTimedOut."""
    try:
        await asyncio.wait_for(asyncio.wrap_future(admitted), timeout_s)
    except asyncio.CancelledError:
        abort()
        raise
    except asyncio.TimeoutError:
        abort()
        raise RequestTimedOut(timeout_message(timeout_s)) from None


def _describe(exc: BaseException, limit: int = 200) -> str:
    """`Type: message`, cut short: an exception's text can quote data, and a log line should stay a line."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _where(exc: BaseException, frames: int = 6) -> str:
    """The innermost frames as `file.py:line function > ...` (no source lines, no local variables)."""
    summary = traceback.extract_tb(exc.__traceback__)[-frames:]
    return " > ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in summary)
