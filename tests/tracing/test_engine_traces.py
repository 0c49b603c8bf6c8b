"""Spans of a tiny engine, as a collector receives them: request spans with vLLM's attributes and phases,
forward spans linked to the right requests, key-change events on the forward that hit them."""

from __future__ import annotations

import os
from collections import Counter

import pytest

from runtime.config import EngineConfig
from runtime.core import Req, SamplingParams
from runtime.engine import Engine
from runtime.tracing import names

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra is not installed")
from conftest import OTLPReceiver

# Without forward-entry and allocator invalidations, graph-replayed decode steps reuse a stale translation:
# cross_forward and stale_loc events on decode forwards.
FAULTS = ("skip-forward-invalidation", "skip-alloc-invalidation")
BUG_CLASSES = {"cross_forward", "stale_loc"}
SERVER, INTERNAL = 2, 1  # OTLP span kinds


def traced_engine(url: str, **overrides) -> Engine:
    cfg = dict(model="tiny", max_total_tokens=4096, swa_full_tokens_ratio=0.25, chunked_prefill_size=16,
               inject=FAULTS, otlp_traces_endpoint=url)
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg), progress=False)


def drive(engine: Engine, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not engine.step():
            return
    raise AssertionError(f"requests still running after {max_steps} steps")


@pytest.fixture(scope="module")
def run():
    """Three requests (prompts sharing no prefix) through a traced engine, exported on close."""
    otlp_receiver = OTLPReceiver()
    engine = traced_engine(otlp_receiver.url)
    prompts = [[7] * 5, list(range(40, 60)), [3, 1, 4, 1, 5, 9, 2, 6, 5]]
    params = [SamplingParams(max_new_tokens=n, temperature=t, top_p=p, ignore_eos=True)
              for n, t, p in ((4, 0.0, 1.0), (6, 0.7, 0.9), (3, 0.0, 1.0))]
    reqs = [Req(p, sp) for p, sp in zip(prompts, params)]
    for r in reqs:
        engine.scheduler.add(r)
    drive(engine)
    forwards = engine.runner.last_forward_id
    counts = {k: v for k, v in engine.stats.translation.key_change_counts.items() if v}
    engine.close()
    yield reqs, forwards, counts, otlp_receiver
    otlp_receiver.close()


def by_rid(spans):
    return {s.attributes[names.REQUEST_ID]: s for s in spans}


def test_request_spans_carry_what_the_engine_did(run):
    reqs, _, _, receiver = run
    spans = by_rid(receiver.named(names.REQUEST_SPAN))
    assert set(spans) == {r.rid for r in reqs}
    for r in reqs:
        a = spans[r.rid].attributes
        assert spans[r.rid].kind == SERVER and spans[r.rid].parent_span_id == ""
        assert a[names.USAGE_PROMPT_TOKENS] == len(r.prompt_ids)
        assert a[names.USAGE_COMPLETION_TOKENS] == len(r.output_ids) == r.params.max_new_tokens
        assert a[names.REQUEST_MAX_TOKENS] == r.params.max_new_tokens
        assert a[names.REQUEST_TEMPERATURE] == pytest.approx(r.params.temperature)
        assert a[names.REQUEST_TOP_P] == pytest.approx(r.params.top_p)
        assert a[names.RESPONSE_FINISH_REASONS] == ("length",)
        assert a[names.REQUEST_STATUS] == "finished"
        assert a[names.RESPONSE_MODEL] == "tiny"
        assert 0 <= a[names.LATENCY_TIME_IN_QUEUE] <= a[names.LATENCY_TIME_TO_FIRST_TOKEN] <= a[names.LATENCY_E2E]
        assert a[names.LATENCY_TIME_TO_FIRST_TOKEN] == pytest.approx(r.first_token_time - r.arrival_time)
        span = spans[r.rid]
        assert (span.end_ns - span.start_ns) / 1e9 == pytest.approx(a[names.LATENCY_E2E], abs=1e-6)
    resource = spans[reqs[0].rid].resource
    assert resource["service.name"] == names.SERVICE_NAME and resource["process.pid"] == os.getpid()
    assert resource["swa_runtime.model"] == "tiny" and resource[names.LOC_CACHE_POLICY] == "memo"


def test_phases_are_children_that_tile_the_request(run):
    reqs, _, _, receiver = run
    for r, request in by_rid(receiver.named(names.REQUEST_SPAN)).items():
        children = {s.name: s for s in receiver.spans if s.parent_span_id == request.span_id}
        assert set(children) == {names.QUEUE_SPAN, names.PREFILL_SPAN, names.DECODE_SPAN}
        queue, prefill, decode = (children[n] for n in (names.QUEUE_SPAN, names.PREFILL_SPAN, names.DECODE_SPAN))
        assert {s.trace_id for s in children.values()} == {request.trace_id}
        assert request.start_ns == queue.start_ns
        assert queue.end_ns == prefill.start_ns and prefill.end_ns == decode.start_ns
        assert decode.end_ns == request.end_ns
        ttft = request.attributes[names.LATENCY_TIME_TO_FIRST_TOKEN]
        assert (prefill.end_ns - request.start_ns) / 1e9 == pytest.approx(ttft, abs=1e-6)


def test_every_forward_has_a_span_linked_to_its_requests(run):
    reqs, forwards, _, receiver = run
    requests = by_rid(receiver.named(names.REQUEST_SPAN))
    spans = receiver.named(names.FORWARD_SPAN)
    assert sorted(s.attributes[names.FORWARD_ID] for s in spans) == list(range(1, forwards + 1))
    decode_steps, prefilled = Counter(), 0
    for s in spans:
        a = s.attributes
        assert s.kind == INTERNAL and s.parent_span_id == ""
        assert a[names.LOC_CACHE_POLICY] == "memo"
        if a[names.FORWARD_MODE] == "graph_capture":
            assert s.links == [] and a[names.FORWARD_BATCH_SIZE] in (1, 2, 4, 8)
            continue
        assert len(s.links) == a[names.FORWARD_BATCH_SIZE] > 0
        for trace_id, span_id, attributes in s.links:
            request = requests[attributes[names.REQUEST_ID]]
            assert (trace_id, span_id) == (request.trace_id, request.span_id)
        if a[names.FORWARD_MODE] == "eager_extend":
            prefilled += a[names.FORWARD_TOKENS]
        else:
            assert a[names.FORWARD_TOKENS] == a[names.FORWARD_BATCH_SIZE]
            decode_steps.update(attributes[names.REQUEST_ID] for _, _, attributes in s.links)
    assert prefilled == sum(len(r.prompt_ids) for r in reqs)
    # the prefill samples the first token; every further token is one decode forward of that request
    assert decode_steps == {r.rid: len(r.output_ids) - 1 for r in reqs}


def test_key_change_events_sit_on_the_forward_and_reach_its_requests(run):
    _, _, counts, receiver = run
    requests = by_rid(receiver.named(names.REQUEST_SPAN))
    seen = Counter()
    for s in receiver.named(names.FORWARD_SPAN):
        events = [attributes for name, attributes in s.events if name == names.KV_EVENT]
        for e in events:
            assert e["forward_id"] == s.attributes[names.FORWARD_ID]
            assert e["mode"] == s.attributes[names.FORWARD_MODE] == "graph_replay"
            assert e["policy"] == "memo" and e["prev_forward_id"] < e["forward_id"]
            seen[e["site"], e["classification"]] += 1
        flagged = {(e["classification"], e["site"]) for e in events if e["classification"] in BUG_CLASSES}
        for _, _, link in s.links:
            noted = {(a["classification"], a["site"]) for name, a in requests[link[names.REQUEST_ID]].events
                     if name == names.KV_EVENT and a["forward_id"] == s.attributes[names.FORWARD_ID]}
            assert noted == flagged
    assert {c for _, c in seen} == BUG_CLASSES
    assert seen == counts  # every counted event is on a forward span, once


def test_retraction_and_abort_end_the_request_span(otlp_receiver):
    """A pool too small for both requests retracts one to the host tier (an event on its span); an abort
    ends a span too."""
    engine = traced_engine(otlp_receiver.url, inject=(), max_total_tokens=96, swa_full_tokens_ratio=0.5,
                           max_running_requests=2, graphs=False, disable_prefix_caching=True, hicache_size=256)
    long = [Req(list(range(1, 31)), SamplingParams(max_new_tokens=30, ignore_eos=True)) for _ in range(2)]
    waiting = Req([9, 9, 9], SamplingParams(max_new_tokens=4))
    for r in (*long, waiting):
        engine.scheduler.add(r)
    engine.scheduler.abort(waiting.rid)
    drive(engine)
    engine.close()
    spans = by_rid(otlp_receiver.named(names.REQUEST_SPAN))
    retracted = [s for s in spans.values() if s.attributes[names.REQUEST_RETRACTIONS] > 0]
    assert retracted, "the workload was meant to retract a request"
    for s in retracted:
        kinds = [a["kind"] for name, a in s.events if name == names.RETRACTED_EVENT]
        assert len(kinds) == s.attributes[names.REQUEST_RETRACTIONS] and set(kinds) == {"offload"}
        assert s.attributes[names.USAGE_COMPLETION_TOKENS] == 30
    aborted = spans[waiting.rid]
    assert aborted.attributes[names.REQUEST_STATUS] == "aborted"
    assert aborted.attributes[names.USAGE_COMPLETION_TOKENS] == 0
    assert names.LATENCY_TIME_IN_QUEUE not in aborted.attributes  # never admitted
    children = [c.name for c in otlp_receiver.spans if c.parent_span_id == aborted.span_id]
    assert children == [names.QUEUE_SPAN]


def test_traceparent_continues_the_clients_trace(otlp_receiver):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    engine = traced_engine(otlp_receiver.url, inject=())
    req = Req([5, 6, 7], SamplingParams(max_new_tokens=2), traceparent=f"00-{trace_id}-{parent_id}-01")
    engine.scheduler.add(req)
    drive(engine)
    engine.close()
    (span,) = otlp_receiver.named(names.REQUEST_SPAN)
    assert (span.trace_id, span.parent_span_id) == (trace_id, parent_id)
