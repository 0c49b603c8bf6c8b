"""Engine supervision: a heartbeat over the pipe, restarts of a dead engine within a budget, then give up.

The front end cannot tell a busy engine from a wedged one by waiting on requests, so a thread here pings the
engine process (`EngineProcess.ping`, answered by its pipe reader) every `heartbeat_interval_s`:

- no answer for `heartbeat_timeout_s` (the process is stopped, or its interpreter wedged), or a step that has
  run for longer than `stall_timeout_s`: the engine counts as down (`/health` 503 with the reason, new
  requests 503, `swa_runtime_engine_up` 0) until it answers again;
- still down after `hang_kill_s`: the process is killed, which makes it a dead engine;
- a dead engine (it exited, was killed, crashed) is restarted after a back-off that doubles from
  `backoff_s` to `max_backoff_s`; each restart counts in `swa_runtime_engine_restarts_total`;
- more than `max_restarts` restarts within `restart_window_s` (or a restart that fails to start): the
  supervisor gives up and calls `on_give_up(reason)`, and `serve` exits non-zero so that an outside
  supervisor (systemd, Kubernetes, `swa-runtime fleet`) takes over.
Nothing here runs while a shutdown drains the engine: its exit is expected.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from runtime.server.engine_process import EngineProcess
from telemetry.stats import FrontEndStats

log = structlog.get_logger("swa_runtime.server")


@dataclass(frozen=True)
class SupervisionPolicy:
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 3.0  # no heartbeat answer for this long: down (503)
    stall_timeout_s: float = 300.0  # one engine step running this long: down (a step that never returns)
    hang_kill_s: float = 30.0  # down (no answer or stalled) this long: kill the process, then restart it
    max_restarts: int = 5  # restarts allowed within restart_window_s; one more and the server gives up
    restart_window_s: float = 600.0
    backoff_s: float = 1.0  # wait before the first restart; doubles for each restart within the window
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"--engine-max-restarts must be >= 0, got {self.max_restarts}")
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "stall_timeout_s", "hang_kill_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds")
        if self.hang_kill_s < self.heartbeat_timeout_s:
            raise ValueError("--engine-hang-kill must be at least the heartbeat timeout "
                             f"({self.heartbeat_timeout_s:g} s)")


class EngineSupervisor:
    """Watches one `EngineProcess` from a daemon thread (see the module docstring)."""

    def __init__(self, engine: EngineProcess, stats: FrontEndStats, policy: SupervisionPolicy = SupervisionPolicy(),
                 on_give_up: Callable[[str], None] = lambda reason: None):
        self.engine = engine
        self.stats = stats
        self.policy = policy
        self.on_give_up = on_give_up
        self.gave_up: str | None = None
        self._restarts: collections.deque[float] = collections.deque()  # monotonic times, within the window
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.engine.restartable = self.policy.max_restarts > 0
        self._thread = threading.Thread(target=self._run, name="swa-runtime-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.engine.restartable = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)

    def _run(self) -> None:
        p = self.policy
        answered, down = time.monotonic(), False
        while not self._stop.wait(p.heartbeat_interval_s):
            if self.engine.stopping:
                return
            if self.engine.exited:
                if not self._restart():
                    return
                answered, down = time.monotonic(), False
                continue
            try:  # wait for the answer no longer than the timeout: a stopped process never answers
                busy_s = self.engine.ping().result(p.heartbeat_timeout_s)["busy_s"]
            except Exception:  # noqa: BLE001 - no answer in time, or the process just died
                busy_s = None
            now = time.monotonic()
            if busy_s is not None and busy_s < p.stall_timeout_s:
                answered = now
                if down:
                    log.warning("engine_process_answers_again")
                    self.engine.mark_unresponsive(None)
                    down = False
                continue
            silent = now - answered
            if busy_s is not None:
                why = f"the engine step has run for {busy_s:.0f} s (stalled?)"
            else:
                why = f"the engine process has not answered its heartbeat for {silent:.1f} s (hung?)"
            if silent >= p.heartbeat_timeout_s or busy_s is not None:
                if not down and not self.engine.exited:
                    log.error("engine_process_unresponsive", reason=why)
                self.engine.mark_unresponsive(why)
                down = True
            if silent >= p.hang_kill_s:
                log.error("engine_process_killed", reason=why, after_s=round(silent, 1))
                self.engine.kill()

    def _restart(self) -> bool:
        """Restart the dead engine after the back-off; False (and `on_give_up`) when the budget is spent."""
        p = self.policy
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > p.restart_window_s:
            self._restarts.popleft()
        if len(self._restarts) >= p.max_restarts:
            return self._give_up(f"the engine process died {len(self._restarts) + 1} times within "
                                 f"{p.restart_window_s:g} s (--engine-max-restarts {p.max_restarts})")
        backoff = min(p.max_backoff_s, p.backoff_s * 2 ** len(self._restarts))
        log.warning("engine_process_restarting", reason=self.engine.down_reason, backoff_s=backoff)
        if self._stop.wait(backoff) or self.engine.stopping:
            return False
        self._restarts.append(time.monotonic())
        try:
            self.engine.restart()
        except RuntimeError as exc:
            return self._give_up(f"the engine process could not be restarted: {exc}")
        self.stats.engine_restarts += 1
        log.warning("engine_process_restarted", restarts_in_window=len(self._restarts))
        return True

    def _give_up(self, reason: str) -> bool:
        self.gave_up = reason
        self.engine.restartable = False
        log.error("engine_supervisor_gave_up", reason=reason)
        self.on_give_up(reason)
        return False
