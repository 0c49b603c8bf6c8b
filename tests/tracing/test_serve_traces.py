"""`swa-runtime serve --otlp-traces-endpoint`: the option reaches the engine process, which exports the
spans; a client's `traceparent` header continues its trace; a graceful stop exports what is left."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from live_helpers import free_port, wait_for  # tests/ is on sys.path

from runtime.tracing import names

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra is not installed")

REPO = Path(__file__).resolve().parents[2]
TRACE_ID, PARENT_ID = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


def post(url: str, body: dict, headers: dict | None = None) -> dict:
    headers = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=60) as response:
        return json.load(response)


def test_serve_exports_request_and_forward_spans(otlp_receiver, tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "runtime", "serve", "--model", "tiny", "--port", str(port),
           "--max-total-tokens", "512", "--swa-full-tokens-ratio", "0.5", "--chunked-prefill-size", "32",
           "--inject", "skip-forward-invalidation", "--inject", "skip-alloc-invalidation",
           "--otlp-traces-endpoint", otlp_receiver.url]  # a base URL: /v1/traces is appended
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is None and urllib.request.urlopen(f"{url}/health", timeout=2).status == 200,
                 120, "serve /health")
        traced = post(f"{url}/generate", {"input_ids": [2, 10, 11, 12, 13],
                                          "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}},
                      {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
        plain = post(f"{url}/v1/completions", {"prompt": [2, 50, 51, 52, 53, 54, 55, 56], "max_tokens": 5,
                                               "ignore_eos": True})
    finally:
        proc.send_signal(signal.SIGTERM)  # graceful: the engine process flushes its spans as it exits
        assert proc.wait(60) == 0, (tmp_path / "serve.log").read_text()[-2000:]
    requests = otlp_receiver.wait_for(names.REQUEST_SPAN, 2, timeout_s=10)
    assert set(otlp_receiver.paths) == {"/v1/traces"}
    by_trace = {s.trace_id: s for s in requests}
    mine = by_trace.pop(TRACE_ID)
    assert mine.parent_span_id == PARENT_ID
    assert mine.attributes[names.USAGE_COMPLETION_TOKENS] == len(traced["output_ids"]) == 6
    assert mine.attributes[names.USAGE_PROMPT_TOKENS] == 5
    (other,) = by_trace.values()
    assert other.parent_span_id == ""
    assert other.attributes[names.USAGE_COMPLETION_TOKENS] == plain["usage"]["completion_tokens"] == 5
    assert other.attributes[names.USAGE_PROMPT_TOKENS] == plain["usage"]["prompt_tokens"] == 8
    ids = {(s.trace_id, s.span_id) for s in requests}
    forwards = [s for s in otlp_receiver.named(names.FORWARD_SPAN) if s.links]
    assert {(t, s) for f in forwards for t, s, _ in f.links} == ids
    flagged = [e for f in forwards for name, e in f.events if name == names.KV_EVENT]
    assert flagged and {e["classification"] for e in flagged} <= {"cross_forward", "stale_loc"}
    assert mine.resource["service.name"] == names.SERVICE_NAME
