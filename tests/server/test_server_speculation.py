"""Speculative decoding through the HTTP server: the same greedy tokens as without it, streamed one by one,
and the verify forwards and acceptance in /metrics."""

import httpx

from conftest import make_engine, sse_events, start_server

BODY = {"input_ids": [2] + [10, 11, 12, 13, 14, 15] * 6,
        "sampling_params": {"max_new_tokens": 32, "ignore_eos": True}}


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_speculation_through_the_server_returns_the_same_tokens_and_counts_acceptance():
    outputs, streamed = [], []
    for overrides in ({}, {"speculative_algorithm": "ngram", "num_speculative_tokens": 4}):
        srv = start_server(make_engine(**overrides))
        try:
            with httpx.Client(base_url=srv.url, timeout=60) as client:
                outputs.append(client.post("/generate", json=BODY).json()["output_ids"])
                with client.stream("POST", "/generate", json={**BODY, "stream": True}) as r:
                    events = sse_events(r.iter_lines())
                streamed.append([e for e in events if e != "[DONE]"])
                metrics = client.get("/metrics").text
            srv.wait_idle_clean()
        finally:
            srv.stop()
    assert outputs[1] == outputs[0] and len(outputs[0]) == 32
    # each chunk carries the tokens new since the last; joined, every token in order, as without speculation
    assert [t for c in streamed[1] for t in c["output_ids"]] == outputs[0]
    assert [t for c in streamed[0] for t in c["output_ids"]] == outputs[0]
    assert metric(metrics, 'swa_runtime_spec_accepted_tokens_total{algorithm="ngram"}') > 0
    assert metric(metrics, 'swa_runtime_forward_total{mode="target_verify"}') > 0


def test_the_bench_reads_the_engines_acceptance_from_metrics():
    """`bench --serve` measures acceptance as the change of the counters in /metrics: the same numbers as the
    engine's own, and a request's drafts all counted by the time its response is complete."""
    from runtime.bench_serve import spec_counts
    from runtime.spec_counts import SpecCounts

    srv = start_server(make_engine(speculative_algorithm="ngram", num_speculative_tokens=4))
    try:
        before = spec_counts(srv.url)
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            assert len(client.post("/generate", json=BODY).json()["output_ids"]) == 32
        after = spec_counts(srv.url)
        srv.wait_idle_clean()
        assert after == srv.engine_loop.call(lambda: SpecCounts.from_stats(srv.engine.stats.spec)).result(10)
    finally:
        srv.stop()
    delta = after - before
    assert 0 < delta.accepted <= delta.drafted and delta.emitted == delta.accepted + delta.verifies
    assert delta.rate == delta.accepted / delta.drafted and delta.per_verify == delta.emitted / delta.verifies
