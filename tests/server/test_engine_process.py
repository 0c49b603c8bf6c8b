"""The engine in its own process behind the real app on loopback: same tokens as the in-process engine, every
count reaches /metrics, and a dead engine process is reported at once, never hung on."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
import uvicorn
from conftest import run_in_thread, sse_events

from runtime.config import EngineConfig
from runtime.core import SamplingParams
from runtime.engine import Engine
from runtime.models.tokenizer import load_tokenizer
from runtime.server.app import create_app
from runtime.server.connections import uvicorn_config
from runtime.server.engine_process import EngineProcess
from runtime.server.options import ServerOptions

CFG = EngineConfig(model="tiny", max_total_tokens=2048, swa_full_tokens_ratio=0.5, max_running_requests=4,
                   chunked_prefill_size=16, graph_batch_sizes=(1, 2))
PROMPTS = [[2, *range(40, 40 + n)] for n in (5, 17, 30)]
NEW = 12
JSON = {"Content-Type": "application/json"}


class ProcessServer:
    def __init__(self):
        self.engine = EngineProcess(CFG, load_tokenizer("tiny"))
        self.engine.start()
        opts = ServerOptions(port=0, shutdown_timeout_s=5.0)
        app = create_app(self.engine, model_name="tiny", options=opts)
        server = uvicorn.Server(uvicorn_config(app, opts, log_level="warning"))
        self.server, self.thread, self.url = run_in_thread(server)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.stop(1.0)


@pytest.fixture(scope="module")
def reference():
    engine = Engine(CFG, progress=False)
    return engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))


@pytest.fixture
def served():
    srv = ProcessServer()
    yield srv
    srv.stop()


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_outputs_and_counts_through_the_engine_process(served, reference):
    with httpx.Client(base_url=served.url, timeout=60) as c:
        outs = [c.post("/generate", headers=JSON, json={"input_ids": p, "sampling_params": {
            "max_new_tokens": NEW, "ignore_eos": True}}).json()["output_ids"] for p in PROMPTS]
        refused = c.post("/generate", headers=JSON, json={"input_ids": [2, 999999]})
        metrics = c.get("/metrics").text
        health = c.get("/health").json()
    assert outs == reference
    assert refused.status_code == 400
    assert metric(metrics, 'swa_runtime_requests_total{status="finished"}') == len(PROMPTS)
    assert metric(metrics, 'swa_runtime_requests_total{status="rejected"}') == 1  # counted in the engine process
    assert metric(metrics, "swa_runtime_generation_tokens_total") == len(PROMPTS) * NEW
    assert metric(metrics, "swa_runtime_prompt_tokens_total") == sum(map(len, PROMPTS))
    assert "process_cpu_seconds_total" in metrics  # the front end's own process metrics, once
    assert metrics.count("# TYPE process_cpu_seconds_total") == 1
    assert health == {"status": "ok", "running": 0, "waiting": 0}
    served.engine.call("assert_idle_clean").result(10)


def test_concurrent_streams_each_get_their_own_tokens_and_logprobs_through_the_engine_process(served, reference):
    """Three requests decode in the same steps, whose tokens cross the pipe together: each stream gets its own,
    in order, each with its logprob, then its end."""
    tokenizer = load_tokenizer("tiny")
    results = {}

    def run(i):
        with httpx.Client(base_url=served.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", headers=JSON, json={
                    "model": "tiny", "prompt": PROMPTS[i], "max_tokens": NEW, "temperature": 0, "logprobs": 1,
                    "stream": True, "ignore_eos": True}) as r:
                results[i] = sse_events(list(r.iter_lines()))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, ids in enumerate(reference):
        chunks = [e["choices"][0] for e in results[i] if e != "[DONE]" and e["choices"]]
        assert "".join(ch["text"] for ch in chunks) == tokenizer.decode(ids)
        logprobs = [v for ch in chunks if ch["logprobs"] for v in ch["logprobs"]["token_logprobs"]]
        assert len(logprobs) == NEW and all(v <= 0 for v in logprobs)
        assert chunks[-1]["finish_reason"] == "length" and results[i][-1] == "[DONE]"
    served.engine.call("assert_idle_clean").result(10)


def test_a_killed_engine_process_ends_live_streams_with_an_error_and_health_says_so(served):
    with httpx.Client(base_url=served.url, timeout=60) as c:
        got_tokens = threading.Event()
        result = {}

        def stream():
            with c.stream("POST", "/generate", headers=JSON, json={
                    "input_ids": PROMPTS[0], "stream": True,
                    "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}) as r:
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    if line.startswith("data: {") and '"text"' in line:
                        got_tokens.set()
                result["events"] = sse_events(lines)

        t = threading.Thread(target=stream)
        t.start()
        assert got_tokens.wait(30)
        started = time.monotonic()
        os.kill(served.engine._process.pid, signal.SIGKILL)
        t.join(30)
        assert not t.is_alive() and time.monotonic() - started < 10  # reported, not hung on
        last = [e for e in result["events"] if e != "[DONE]"][-1]
        assert "error" in last and "engine process stopped" in last["error"]["message"]
        health = c.get("/health")
        assert health.status_code == 503 and "engine process is not running" in health.json()["error"]["message"]
        after = c.post("/generate", headers=JSON, json={"input_ids": PROMPTS[0]})
        assert after.status_code == 503
    assert served.engine.exitcode == -signal.SIGKILL
