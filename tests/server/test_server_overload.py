"""Overload: beyond the running batch and `--max-queued-requests` waiting requests, the server answers 429
with Retry-After and an OpenAI-style error body at once, counts each as `refused`, and every request it did
accept still finishes in full."""

import asyncio
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from conftest import make_engine, start_server

RUNNING, QUEUED, SENT, NEW = 2, 3, 24, 40


def _refused_metric(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "swa_runtime_requests_total" and s.labels == {"status": "refused"})


def test_a_burst_beyond_the_queue_is_refused_and_the_accepted_all_finish():
    srv = start_server(make_engine(max_running_requests=RUNNING, graphs=False), max_queued_requests=QUEUED)
    forward = srv.engine.runner.forward
    srv.engine.runner.forward = lambda batch: (time.sleep(0.005), forward(batch))[1]  # keep the batch busy
    counts = srv.engine.stats.request_counts
    try:
        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                async def one(i):
                    start = time.monotonic()
                    r = await client.post("/generate", json={"input_ids": [2, 30 + i], "sampling_params": {
                        "max_new_tokens": NEW, "ignore_eos": True}})
                    return r, time.monotonic() - start
                return await asyncio.gather(*(one(i) for i in range(SENT)))

        results = asyncio.run(burst())
        srv.wait_idle_clean()
        accepted = [r for r, _ in results if r.status_code == 200]
        refused = [(r, t) for r, t in results if r.status_code == 429]
        assert len(accepted) + len(refused) == SENT, [r.status_code for r, _ in results]
        assert RUNNING + QUEUED <= len(accepted) < SENT // 2
        assert all(len(r.json()["output_ids"]) == NEW for r in accepted)
        for r, seconds in refused:
            assert r.headers["retry-after"] == "1"
            assert r.json() == {"error": {
                "message": f"the server is busy: {QUEUED} requests are already waiting (--max-queued-requests); "
                           "retry later", "type": "rate_limit_error", "code": 429}}
        assert max(t for _, t in refused) < min(t for r, t in results if r.status_code == 200)  # refused at once
        assert (counts["refused"], counts["finished"]) == (len(refused), len(accepted))
        assert _refused_metric(srv.url) == len(refused)

        # the queue drained: the next request is served
        r = httpx.post(f"{srv.url}/generate", json={"input_ids": [2, 3], "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200 and httpx.get(f"{srv.url}/health").json()["status"] == "ok"
        srv.wait_idle_clean()
    finally:
        srv.stop()
