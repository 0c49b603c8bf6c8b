"""The engine thread's life: idle without spinning, surviving a failing step, draining on shutdown, and the
real `swa-runtime serve` process stopping cleanly on SIGTERM."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import RecordingLogger, make_engine, sse_events, start_server
from runtime.server.engine_loop import SHUTDOWN_MESSAGE

SHUTDOWN_ERROR = {"error": {"message": SHUTDOWN_MESSAGE, "type": "service_unavailable", "code": 503}}


@pytest.fixture
def server():
    srv = start_server(make_engine(graphs=False))
    yield srv
    srv.stop()


def _cpu_ticks(thread: threading.Thread) -> int:
    fields = open(f"/proc/self/task/{thread.native_id}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_idle_engine_thread_sleeps(server):
    thread = server.engine_loop._thread
    before = _cpu_ticks(thread)
    time.sleep(1.0)
    assert _cpu_ticks(thread) - before <= 2  # a spinning thread would burn ~100 ticks a second


def test_a_failing_step_fails_its_requests_and_the_server_keeps_serving():
    """The running batch ends with status `error` (not `aborted`); the failure is logged once per minute,
    as one line without local variables or request contents; repeats are counted as suppressed."""
    logger = RecordingLogger()
    server = start_server(make_engine(graphs=False), logger=logger)
    engine = server.engine
    real_step, calls = engine.step, []

    def flaky_step():
        calls.append(1)
        if len(calls) == 3:  # mid-generation of the running requests
            raise RuntimeError("boom")
        return real_step()

    engine.step = flaky_step
    counts = engine.stats.request_counts
    before = dict(counts)
    suppressed = engine.stats.suppressed_counts["engine_step_failed"]
    prompt = [2, 40, 41, 97, 98, 99]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}}
    message = "internal error in the engine step: RuntimeError: boom"
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
                events = sse_events(r.iter_lines())
            assert events[-1] == "[DONE]"
            assert events[-2] == {"error": {"message": message, "type": "internal_error", "code": 500}}
            server.wait_idle_clean()

            calls.clear()
            r = client.post("/generate", json=body)
            assert r.status_code == 500 and r.json()["error"]["message"] == message
            server.wait_idle_clean()

            assert client.get("/health").status_code == 200
            r = client.post("/generate", json=body)
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 20
        server.wait_idle_clean()
    finally:
        server.stop()

    assert {k: counts[k] - before[k] for k in counts} == {
        "finished": 1, "aborted": 0, "rejected": 0, "refused": 0, "error": 2, "other": 0}
    (record,) = logger.events("engine_step_failed")  # the second failure fell in the same minute
    assert record["error"] == "RuntimeError: boom" and record["running"] == 1
    assert "test_server_lifecycle.py" in record["where"] and "flaky_step" in record["where"]
    assert engine.stats.suppressed_counts["engine_step_failed"] - suppressed == 1
    logged = repr(logger.records)
    assert "exc_info" not in logged and str(prompt)[1:-1] not in logged, "request contents reached the logs"


def test_log_requests_puts_prompts_in_the_logs():
    logger = RecordingLogger()
    server = start_server(make_engine(graphs=False), logger=logger, log_requests=True)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            r = client.post("/generate", json={"input_ids": [2, 40, 41], "sampling_params": {
                "max_new_tokens": 3, "ignore_eos": True}})
            assert r.status_code == 200
        server.wait_idle_clean()
    finally:
        server.stop()
    (admitted,) = logger.events("request_admitted")
    (finished,) = logger.events("request_finished")
    assert admitted["prompt_ids"] == [2, 40, 41] and admitted["params"]["max_new_tokens"] == 3
    assert finished["output_ids"] == r.json()["output_ids"] and finished["finish_reason"] == "length"


def test_a_client_that_gives_up_on_a_plain_request_aborts_it(server):
    stats = server.engine.stats
    aborted, generated = stats.request_counts["aborted"], stats.generation_tokens
    body = {"input_ids": [2, 70, 71], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    with httpx.Client(base_url=server.url, timeout=0.3) as client, pytest.raises(httpx.ReadTimeout):
        client.post("/generate", json=body)
    server.wait_idle_clean()
    assert stats.request_counts["aborted"] - aborted == 1
    assert stats.generation_tokens - generated < 1000


def test_shutdown_finishes_short_requests_aborts_long_ones_and_refuses_new(server):
    forward = server.engine.runner.forward

    def slow_forward(batch):  # 400 tokens take > 2 s; 10 tokens well under the drain timeout
        time.sleep(0.005)
        return forward(batch)

    server.engine.runner.forward = slow_forward
    results = {}

    def run(name, n):
        with httpx.Client(base_url=server.url, timeout=60) as c:
            body = {"input_ids": [2, 50, 60], "stream": True, "sampling_params": {"max_new_tokens": n,
                                                                                  "ignore_eos": True}}
            with c.stream("POST", "/generate", json=body) as r:
                results[name] = sse_events(r.iter_lines())

    threads = [threading.Thread(target=run, args=("long", 400)), threading.Thread(target=run, args=("short", 10))]
    for t in threads:
        t.start()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        while client.get("/health").json()["running"] < 2:
            time.sleep(0.01)
        finished, aborted = (server.engine.stats.request_counts[s] for s in ("finished", "aborted"))
        server.engine_loop.begin_shutdown(timeout_s=1.0)

        r = client.post("/generate", json={"text": "late"})
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"] == {"message": "the server is shutting down and accepts no new requests",
                                     "type": "service_unavailable", "code": 503}
        for t in threads:
            t.join(30)
        server.engine_loop._thread.join(30)
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["error"]["message"] == "the engine thread is not running"
        r = client.post("/generate", json={"text": "later"})
        assert r.status_code == 503 and r.json()["error"]["message"] == "the engine thread is not running"

    short, long = results["short"][:-1], results["long"][:-1]
    assert results["short"][-1] == results["long"][-1] == "[DONE]"
    assert short[-1]["meta"]["finish_reason"] == "length" and short[-1]["meta"]["completion_tokens"] == 10
    # cut by the shutdown: an error event after the tokens it got, never a quiet "finish_reason": "abort"
    assert long[-1] == SHUTDOWN_ERROR
    assert all(c["meta"]["finish_reason"] is None for c in long[:-1]) and len(long) > 1
    assert sum(len(c["output_ids"]) for c in long[:-1]) < 400
    stats = server.engine.stats.request_counts
    assert (stats["finished"] - finished, stats["aborted"] - aborted) == (1, 1)
    server.engine.scheduler.assert_idle_clean()  # the engine thread has ended: safe to look directly


def test_shutdown_answers_queued_and_running_requests_with_503():
    """A plain request still queued when the drain deadline passes gets a 503 with the reason, not a 200
    with empty output; the running stream gets an error event."""
    server = start_server(make_engine(graphs=False, max_running_requests=1))
    forward = server.engine.runner.forward
    server.engine.runner.forward = lambda batch: (time.sleep(0.005), forward(batch))[1]
    results = {}

    def stream():
        body = {"input_ids": [2, 50, 60], "stream": True, "sampling_params": {"max_new_tokens": 900,
                                                                              "ignore_eos": True}}
        with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/generate", json=body) as r:
            results["stream"] = sse_events(r.iter_lines())

    def plain():
        body = {"model": "tiny", "prompt": [2, 7], "max_tokens": 5}
        results["plain"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    try:
        threads[0].start()
        while server.engine.scheduler.num_running() < 1:
            time.sleep(0.01)
        threads[1].start()
        while server.engine.scheduler.num_waiting() < 1:
            time.sleep(0.01)
        aborted = server.engine.stats.request_counts["aborted"]
        server.engine_loop.begin_shutdown(timeout_s=0.2)
        for t in threads:
            t.join(30)
        server.engine_loop._thread.join(30)
        health = httpx.get(f"{server.url}/health", timeout=10)
    finally:
        server.stop()
    assert health.status_code == 503 and health.json()["error"]["message"] == "the engine thread is not running"
    assert results["plain"].status_code == 503 and results["plain"].json() == SHUTDOWN_ERROR
    assert results["stream"][-2:] == [SHUTDOWN_ERROR, "[DONE]"]
    assert server.engine.stats.request_counts["aborted"] - aborted == 2
    server.engine.scheduler.assert_idle_clean()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_process_drains_and_exits_cleanly_on_sigterm():
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", "--model", "tiny", "--port", str(port),
                             "--disable-graphs", "--shutdown-timeout", "0.6"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        with httpx.Client(base_url=url, timeout=60) as client, httpx.Client(base_url=url, timeout=10) as kept:
            assert kept.get("/health").status_code == 200  # a kept-alive connection, idle during the drain
            body = {"input_ids": [2, 9, 9], "stream": True, "sampling_params": {"max_new_tokens": 1000,
                                                                                "ignore_eos": True}}
            with client.stream("POST", "/generate", json=body) as r:
                lines = r.iter_lines()
                first = next(lines)
                # the drain deadline (0.6 s) well inside the stream's 1000 steps (2 s on a 2-core EPYC of
                # 2026-11-26; a deadline of 2 s let the stream finish there first)
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.2)
                # draining: the listener and kept-alive connections stay open and say so, then close
                health = kept.get("/health")
                fresh = httpx.post(f"{url}/generate", json={"input_ids": [2, 9]}, timeout=10)
                events = sse_events([first, *lines])
        assert health.status_code == 503 and health.headers["connection"] == "close"
        assert health.json()["error"]["message"] == "the server is shutting down"
        assert fresh.status_code == 503 and fresh.headers["connection"] == "close"
        assert "shutting down" in fresh.json()["error"]["message"]
        assert events[-2:] == [SHUTDOWN_ERROR, "[DONE]"]
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read()
    assert f"listening on http://127.0.0.1:{port} serving tiny" in out and "Finished server process" in out
