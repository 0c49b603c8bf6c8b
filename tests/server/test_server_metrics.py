"""`/metrics` after a scripted workload: parsed with prometheus_client's parser, exact counts.

Definitions checked here: TTFT is observed once per request that produced a first token; inter-token latency
once per later token (so a request of n generated tokens adds n - 1); end-to-end latency once per finished
request; prompt tokens are counted when a request is admitted (a rejected request adds none).
"""

import httpx
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from conftest import make_engine, sse_events, start_server

# (prompt tokens, new tokens); ignore_eos everywhere so that the lengths are exact
NON_STREAMED = ((5, 4), (12, 7), (30, 10))
STREAMED = (9, 6)
TEXT = "hello"  # the byte tokenizer: BOS + 5 bytes
TEXT_NEW = 3


@pytest.fixture(scope="module")
def fresh():
    srv = start_server(make_engine())
    yield srv
    srv.stop()


def scrape(client) -> dict[tuple[str, tuple], float]:
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"] == CONTENT_TYPE_LATEST
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_metrics_count_exactly_what_was_sent(fresh):
    with httpx.Client(base_url=fresh.url, timeout=60) as client:
        before = scrape(client)
        assert before[("swa_runtime_requests_total", (("status", "finished"),))] == 0

        for n_prompt, n_new in NON_STREAMED:
            r = client.post("/generate", json={"input_ids": [2] + [40 + i for i in range(n_prompt - 1)],
                                               "sampling_params": {"max_new_tokens": n_new, "ignore_eos": True}})
            assert r.status_code == 200 and len(r.json()["output_ids"]) == n_new
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": TEXT, "max_tokens": TEXT_NEW,
                                                 "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(TEXT) + 1
        n_prompt, n_new = STREAMED
        with client.stream("POST", "/generate", json={
                "input_ids": list(range(4, 4 + n_prompt)), "stream": True,
                "sampling_params": {"max_new_tokens": n_new, "ignore_eos": True}}) as r:
            events = sse_events(r.iter_lines())
        assert sum(len(e["output_ids"]) for e in events[:-1]) == n_new
        # rejected at admission (longer than the context), and refused before it (schema): only the first counts
        assert client.post("/generate", json={"input_ids": [5] * 1100}).status_code == 400
        assert client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 0}}).status_code == 400

        fresh.wait_idle_clean()
        after = scrape(client)

    prompts = [p for p, _ in NON_STREAMED] + [len(TEXT) + 1, STREAMED[0]]
    generated = [n for _, n in NON_STREAMED] + [TEXT_NEW, STREAMED[1]]
    expected = {
        ("swa_runtime_requests_total", (("status", "finished"),)): 5,
        ("swa_runtime_requests_total", (("status", "rejected"),)): 1,
        ("swa_runtime_requests_total", (("status", "aborted"),)): 0,
        ("swa_runtime_requests_total", (("status", "refused"),)): 0,
        ("swa_runtime_requests_total", (("status", "error"),)): 0,
        ("swa_runtime_requests_total", (("status", "other"),)): 0,
        ("swa_runtime_prompt_tokens_total", ()): sum(prompts),
        ("swa_runtime_generation_tokens_total", ()): sum(generated),
        ("swa_runtime_time_to_first_token_seconds_count", ()): 5,
        ("swa_runtime_inter_token_latency_seconds_count", ()): sum(n - 1 for n in generated),
        ("swa_runtime_e2e_request_latency_seconds_count", ()): 5,
        ("swa_runtime_num_running_reqs", ()): 0,
        ("swa_runtime_num_queue_reqs", ()): 0,
        ("swa_runtime_kv_tokens", (("pool", "full"), ("state", "used"))): 0,
        ("swa_runtime_kv_tokens", (("pool", "swa"), ("state", "used"))): 0,
    }
    got = {k: after[k] - before.get(k, 0) if not k[0].startswith(("swa_runtime_num", "swa_runtime_kv")) else after[k]
           for k in expected}
    assert got == expected
    for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        count = after[(f"swa_runtime_{name}_seconds_count", ())]
        assert after[(f"swa_runtime_{name}_seconds_bucket", (("le", "+Inf"),))] == count
        assert after[(f"swa_runtime_{name}_seconds_sum", ())] > 0
    for pool in ("full", "swa"):
        total = after[("swa_runtime_kv_tokens", (("pool", pool), ("state", "total")))]
        assert total > 0 and after[("swa_runtime_kv_tokens", (("pool", pool), ("state", "available")))] == total
    build = [k for k in after if k[0] == "swa_runtime_build_info"]
    assert len(build) == 1 and dict(build[0][1])["model"] == "tiny" and after[build[0]] == 1
    # `auto` on a model built beforehand (a float32 tiny model) resolves to what that model is
    assert (dict(build[0][1])["dtype"], dict(build[0][1])["quantization"]) == ("float32", "none")


def test_a_model_given_as_a_path_puts_no_path_in_any_label(tmp_path):
    """`--model /some/dir/name.gguf`: build_info's `model` is the file stem, and no label value of any series
    carries the directory (labels must not leak file-system paths)."""
    secret = tmp_path / "private-models-dir"
    srv = start_server(make_engine(model=str(secret / "my-gemma.gguf")))
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            r = client.post("/generate", json={"input_ids": [2, 40, 41], "sampling_params": {
                "max_new_tokens": 2, "ignore_eos": True}})
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
            samples = scrape(client)
            health = client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        srv.wait_idle_clean()
    finally:
        srv.stop()
    (build,) = [dict(labels) for name, labels in samples if name == "swa_runtime_build_info"]
    assert build["model"] == "my-gemma"
    leaked = sorted({v for _, labels in samples for _, v in labels if "/" in v or "private-models-dir" in v})
    assert leaked == [], f"label values carrying a path: {leaked}"
