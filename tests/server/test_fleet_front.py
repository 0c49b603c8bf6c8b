"""The fleet's public port (runtime/fleet_front.py) in front of a live tiny server on loopback: the API routes
are forwarded (streams included), foreign sites get 403, every other route 404 and never reaches upstream."""

from __future__ import annotations


import httpx
import pytest
import uvicorn
from conftest import run_in_thread, sse_events

from runtime.fleet_front import create_front
from runtime.server.site_guard import SitePolicy

BODY = {"input_ids": [2, 40, 41, 42], "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}


@pytest.fixture(scope="module")
def front(live):
    server, thread, url = run_in_thread(uvicorn.Server(uvicorn.Config(
        create_front(live.url, SitePolicy()), host="127.0.0.1", port=0, log_level="warning", lifespan="on")))
    yield url
    server.should_exit = True
    thread.join(10)


def test_api_routes_are_forwarded_with_the_same_answers(front, client, live):
    with httpx.Client(base_url=front, timeout=60) as c:
        direct = client.post("/generate", json=BODY).json()
        through = c.post("/generate", json=BODY)
        assert through.status_code == 200 and through.json()["output_ids"] == direct["output_ids"]
        with c.stream("POST", "/generate", json={**BODY, "stream": True}) as r:
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]" and sum(len(e["output_ids"]) for e in events[:-1]) == 5
        assert c.get("/health").json()["status"] == "ok"
        assert c.get("/v1/models").status_code == 200
        refused = c.post("/generate", json={"input_ids": [2, 999999]})
        assert refused.status_code == 400  # upstream's error, passed through
    live.wait_idle_clean()


def test_foreign_sites_and_other_routes_are_refused_before_upstream(front, client):
    upstream_answers = _answers(client)  # every answer the upstream gave, counted there
    with httpx.Client(base_url=front, timeout=10) as c:
        for headers in ({"Origin": "http://evil.example"}, {"Host": "evil.example"}):
            r = c.post("/generate", json=BODY, headers=headers)
            assert r.status_code == 403 and "evil.example" in r.json()["error"]["message"]
        for method, path in (("GET", "/workers"), ("POST", "/workers"), ("DELETE", "/workers/1"),
                             ("POST", "/abort_request"), ("GET", "/metrics"), ("GET", "/generate")):
            r = c.request(method, path, json={} if method == "POST" else None)
            assert r.status_code == 404 and "public port" in r.json()["error"]["message"], (method, path)
    assert _answers(client) == upstream_answers + 1  # only our own /metrics read reached it


def _answers(client) -> int:
    text = client.get("/metrics").text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("swa_runtime_http_responses_total{")))
