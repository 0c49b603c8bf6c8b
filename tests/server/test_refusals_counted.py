"""Every answer is counted: a mix of accepted and refused requests (each refusal the front end makes before
the engine sees anything, and a connection cut off before its headers) adds up, code by code, in
`swa_runtime_http_responses_total` to exactly what was sent."""

from __future__ import annotations

import socket
import time
from collections import Counter

import httpx
import pytest
from conftest import make_engine, start_server
from prometheus_client.parser import text_string_to_metric_families

OK = {"input_ids": [2, 40, 41], "sampling_params": {"max_new_tokens": 2}}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def srv():
    server = start_server(make_engine(), max_request_bytes=8000, header_timeout_s=0.5)
    yield server
    server.stop()


def responses(c: httpx.Client) -> Counter:
    counts = Counter()
    for family in text_string_to_metric_families(c.get("/metrics").text):
        if family.name == "swa_runtime_http_responses":
            for s in family.samples:
                counts[s.labels["code"]] = int(s.value)
    return counts


def test_every_refusal_is_counted_by_its_code_and_the_total_adds_up(srv):
    host, port = srv.url.removeprefix("http://").split(":")
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        before = responses(c)  # this scrape's own 200 is counted once it is answered
        sent = [
            c.post("/generate", json=OK),
            c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}),
            c.post("/generate", content=b"{not json", headers=JSON),  # 400 malformed
            c.post("/generate", json={"input_ids": [2] * 1100}),  # 400: cannot fit the context of 1024
            c.post("/generate", json=OK, headers={"Host": "evil.example"}),  # 403 foreign Host
            c.post("/generate", json=OK, headers={"Origin": "http://evil.example"}),  # 403 foreign Origin
            c.post("/abort_request", json={"abort_all": True}),  # 403: no admin token configured
            c.get("/no/such/route"),  # 404
            c.post("/generate", json={**OK, "model": "other"}),  # 404 model
            c.get("/generate"),  # 405
            c.post("/generate", content=b"x" * 9000, headers=JSON),  # 413
            c.post("/generate", content=b"{}", headers={"Content-Type": "text/plain"}),  # 415
            c.post("/generate", json={"input_ids": [2], "sampling_params": {"max_new_tokens": -1}}),  # 400: breaks the schema
        ]
        silent = socket.create_connection((host, int(port)))  # says nothing: 408 after the header timeout
        silent.settimeout(5)
        assert silent.recv(4096).startswith(b"HTTP/1.1 408")
        silent.close()
        codes = Counter(str(r.status_code) for r in sent) + Counter({"408": 1, "200": 1})  # + the first scrape
        after = responses(c)
    delta = after - before
    assert dict(delta) == dict(codes), (delta, codes)
    assert sum(delta.values()) == len(sent) + 2
    assert set(codes) >= {"200", "400", "403", "404", "405", "408", "413", "415"}
