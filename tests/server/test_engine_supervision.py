"""Engine supervision for real: the engine process is killed (SIGKILL) and stopped (SIGSTOP) under a live
server on loopback. /health says why within seconds, /metrics keeps answering with the front end's series,
a dead engine is restarted (counted; its series back from 0; the requests it took counted `error`; a request
arriving meanwhile held until it is back; greedy outputs token-identical), a hung one is reported, then killed
and restarted, a request never outlives its deadline, and a spent restart budget makes `serve` exit with
status 3."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from conftest import run_in_thread, sse_events
from live_helpers import free_port

from runtime.config import EngineConfig
from runtime.models.tokenizer import load_tokenizer
from runtime.server.app import create_app
from runtime.server.connections import uvicorn_config
from runtime.server.engine_process import EngineProcess
from runtime.server.options import ServerOptions
from runtime.server.supervisor import EngineSupervisor, SupervisionPolicy
from telemetry.stats import FrontEndStats

CFG = EngineConfig(model="tiny", max_total_tokens=2048, swa_full_tokens_ratio=0.5, max_running_requests=4,
                   chunked_prefill_size=16, graph_batch_sizes=(1, 2))
PROMPTS = [[2, *range(40, 40 + n)] for n in (5, 17)]
GREEDY = {"max_new_tokens": 10, "ignore_eos": True}
LONG = {"max_new_tokens": 1000, "ignore_eos": True}


class SupervisedServer:
    def __init__(self, policy: SupervisionPolicy, **options):
        self.engine = EngineProcess(CFG, load_tokenizer("tiny"))
        self.engine.start()
        self.stats = FrontEndStats()
        opts = ServerOptions(port=0, shutdown_timeout_s=2.0, **options)
        app = create_app(self.engine, model_name="tiny", options=opts, front_end_stats=self.stats)
        server = uvicorn.Server(uvicorn_config(app, opts, log_level="warning"))
        self.server, self.thread, self.url = run_in_thread(server)
        self.gave_up: list[str] = []
        self.supervisor = EngineSupervisor(self.engine, self.stats, policy, on_give_up=self.gave_up.append)
        self.supervisor.start()

    @property
    def pid(self) -> int:
        return self.engine._process.pid

    def stop(self):
        self.supervisor.stop()
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.stop(1.0)


def fast_policy(**overrides) -> SupervisionPolicy:
    values = dict(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0, hang_kill_s=60.0, backoff_s=0.2)
    values.update(overrides)
    return SupervisionPolicy(**values)


def metric(text: str, sample: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def greedy(c: httpx.Client) -> list[list[int]]:
    return [c.post("/generate", json={"input_ids": p, "sampling_params": GREEDY}).json()["output_ids"]
            for p in PROMPTS]


def stream_in_background(c: httpx.Client) -> tuple[threading.Thread, dict]:
    got_tokens, result = threading.Event(), {}

    def consume():
        with c.stream("POST", "/generate", json={"input_ids": PROMPTS[0], "stream": True,
                                                 "sampling_params": LONG}) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if '"text"' in line:
                    got_tokens.set()
            result["events"] = sse_events(lines)
        result["ended"] = time.monotonic()

    t = threading.Thread(target=consume)
    t.start()
    assert got_tokens.wait(30)
    return t, result


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def timed_get(c: httpx.Client, path: str) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    r = c.get(path)
    return r, time.monotonic() - started


def test_a_killed_engine_is_restarted_its_lost_request_counted_and_outputs_unchanged():
    srv = SupervisedServer(fast_policy())
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            before = greedy(c)
            t, result = stream_in_background(c)
            killed_at = time.monotonic()
            os.kill(srv.pid, signal.SIGKILL)
            t.join(30)
            assert result["ended"] - killed_at < 5
            last = [e for e in result["events"] if e != "[DONE]"][-1]
            assert last["error"]["code"] == 500 and "engine process stopped" in last["error"]["message"]
            health = c.get("/health")
            assert health.status_code == 503, health.text
            assert "engine process" in health.json()["error"]["message"]
            assert c.get("/get_load").json()[0]["num_reqs"] == 0  # the dead request is not load any more
            down, took = timed_get(c, "/metrics")
            assert down.status_code == 200 and took < 1.0
            if not srv.engine.alive:  # still restarting: only the front end's series
                assert metric(down.text, "swa_runtime_engine_up") == 0
                assert "swa_runtime_kv_tokens" not in down.text

            # a request arriving while the engine is replaced waits for it instead of a 503
            held = c.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": GREEDY})
            assert held.status_code == 200 and held.json()["output_ids"] == before[0]
            assert c.get("/health").status_code == 200
            metrics = c.get("/metrics").text
            assert metric(metrics, "swa_runtime_engine_up") == 1
            assert metric(metrics, "swa_runtime_engine_restarts_total") == 1
            assert metric(metrics, 'swa_runtime_requests_total{status="error"}') == 1  # the lost stream
            assert metric(metrics, 'swa_runtime_requests_total{status="finished"}') == 1  # from 0 again: the held one
            assert metric(metrics, 'swa_runtime_kv_tokens{pool="full",state="used"}') == 0
            assert greedy(c) == before
            srv.engine.call("assert_idle_clean").result(10)
        assert srv.gave_up == []
    finally:
        srv.stop()


def test_a_stopped_engine_is_reported_within_seconds_its_request_ends_at_the_deadline_and_it_recovers():
    srv = SupervisedServer(fast_policy(), request_timeout_s=3.0)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            t, result = stream_in_background(c)
            stopped_at = time.monotonic()
            os.kill(srv.pid, signal.SIGSTOP)
            try:
                health = wait_for(lambda: (r := c.get("/health")).status_code == 503 and r, 4,
                                  "/health still 200 with a stopped engine")
                assert time.monotonic() - stopped_at < 4
                assert "has not answered its heartbeat" in health.json()["error"]["message"]
                metrics, took = timed_get(c, "/metrics")
                assert took < 1.0 and metric(metrics.text, "swa_runtime_engine_up") == 0
                assert metric(metrics.text, "process_cpu_seconds_total") is not None
                refused = c.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": GREEDY})
                assert refused.status_code == 503
                t.join(10)
                assert not t.is_alive() and result["ended"] - stopped_at < 5  # the deadline, not forever
                last = [e for e in result["events"] if e != "[DONE]"][-1]
                assert last["error"]["code"] == 504 and "--request-timeout" in last["error"]["message"]
            finally:
                os.kill(srv.pid, signal.SIGCONT)
            wait_for(lambda: c.get("/health").status_code == 200, 10, "the engine did not come back")
            wait_for(lambda: not srv.engine.call("has_work").result(10), 10, "the aborted request still runs")
            srv.engine.call("assert_idle_clean").result(10)
            metrics = c.get("/metrics").text
            assert metric(metrics, "swa_runtime_engine_restarts_total") == 0
            assert metric(metrics, 'swa_runtime_requests_total{status="aborted"}') == 1  # the timed-out stream
            assert metric(metrics, 'swa_runtime_http_responses_total{code="503"}') >= 2
    finally:
        srv.stop()


def test_an_engine_hung_past_the_kill_limit_is_killed_and_restarted():
    srv = SupervisedServer(fast_policy(hang_kill_s=2.0))
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            before = greedy(c)
            hung = srv.pid
            os.kill(hung, signal.SIGSTOP)
            wait_for(lambda: srv.stats.engine_restarts == 1, 30, "the hung engine was not replaced")
            assert srv.pid != hung
            wait_for(lambda: c.get("/health").status_code == 200, 10, "not serving after the restart")
            assert greedy(c) == before
    finally:
        srv.stop()


def children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


def test_serve_exits_with_status_3_once_its_restart_budget_is_spent():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", "--model", "tiny", "--port", str(port),
                             "--engine-max-restarts", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            def up():
                try:
                    return c.get("/health").status_code == 200
                except httpx.TransportError:
                    assert proc.poll() is None, proc.stderr.read().decode()
                    return False

            wait_for(up, 120, "serve did not start")
            (engine,) = [p for p in children(proc.pid) if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]
            os.kill(engine, signal.SIGKILL)
            assert proc.wait(30) == 3
        assert "giving up" in proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
