"""Fixtures for the observability-stack tests: promtool, a fake runtime exporter, a live Prometheus.

The fake exporter serves the metric contract (telemetry/names.py) with prometheus_client, advancing
its counters on every scrape like a runtime under steady decode traffic, so rates, ratios and
histogram quantiles have real values. The runtime itself is not needed.
"""

from __future__ import annotations

import shutil
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from live_helpers import prom_query, start_prometheus, stop, wait_for  # tests/ is on sys.path
from telemetry import names as n

REPO = Path(__file__).resolve().parents[2]
PROM_DIR = REPO / "dashboards" / "prometheus"

# Per scrape of the fake runtime: 15 sliding-layer lookups per forward, the first one a miss.
FORWARDS_PER_SCRAPE = 4
HITS_PER_FORWARD, MISSES_PER_FORWARD = 14, 1


def promtool_path() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not on PATH (Debian package `prometheus`)")
    return path


class FakeRuntime:
    """prometheus_client metrics named by the contract, every label value present from the start."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.hits = Counter(n.LOC_CACHE_HITS, "hits", ["policy", "path"], registry=r)
        self.misses = Counter(n.LOC_CACHE_MISSES, "misses", ["policy", "path", "reason"], registry=r)
        self.invalidations = Counter(n.LOC_CACHE_INVALIDATIONS, "inv", ["policy", "site"], registry=r)
        self.events = Counter(n.LOC_KEY_CHANGE_EVENTS, "events", ["policy", "site", "classification"], registry=r)
        self.translations = Counter(n.LOC_TRANSLATIONS, "gathers", ["policy"], registry=r)
        self.forwards = Counter(n.FORWARD_TOTAL, "forwards", ["mode"], registry=r)
        self.forward_seconds = Histogram(n.FORWARD_SECONDS, "forward s", ["mode"], registry=r)
        self.kv = Gauge(n.KV_TOKENS, "kv", ["pool", "state"], registry=r)
        self.evicted = Counter(n.SWA_EVICTED_TOKENS, "evicted", registry=r)
        self.offloads = Counter(n.HICACHE_OFFLOADS, "offloads", registry=r)
        self.loadbacks = Counter(n.HICACHE_LOADBACKS, "loadbacks", registry=r)
        self.retractions = Counter(n.RETRACTIONS, "retractions", ["kind"], registry=r)
        self.host_bytes = Counter(n.HICACHE_BYTES, "host bytes", ["direction"], registry=r)
        self.prefix_queries = Counter(n.PREFIX_CACHE_QUERIES, "prefix queries", registry=r)
        self.prefix_hits = Counter(n.PREFIX_CACHE_HITS, "prefix hits", registry=r)
        self.prefix_tokens = Gauge(n.PREFIX_CACHE_TOKENS, "prefix tokens", ["pool"], registry=r)
        self.prefix_nodes = Gauge(n.PREFIX_CACHE_NODES, "prefix nodes", ["state"], registry=r)
        self.prefix_evicted = Counter(n.PREFIX_CACHE_EVICTED_TOKENS, "prefix evicted", ["pool"], registry=r)
        self.requests = Counter(n.REQUESTS_TOTAL, "requests", ["status"], registry=r)
        self.prompt = Counter(n.PROMPT_TOKENS, "prompt", registry=r)
        self.generated = Counter(n.GENERATION_TOKENS, "gen", registry=r)
        self.ttft = Histogram(n.TIME_TO_FIRST_TOKEN, "ttft", registry=r)
        self.itl = Histogram(n.INTER_TOKEN_LATENCY, "itl", registry=r)
        self.e2e = Histogram(n.E2E_REQUEST_LATENCY, "e2e", registry=r)
        self.running = Gauge(n.NUM_RUNNING_REQS, "running", registry=r)
        self.queued = Gauge(n.NUM_QUEUE_REQS, "queued", registry=r)
        self.suppressed = Counter(n.LOG_EVENTS_SUPPRESSED, "suppressed", ["event"], registry=r)
        self.spec_draft = Counter(n.SPEC_DRAFT_TOKENS, "drafted", ["algorithm"], registry=r)
        self.spec_accepted = Counter(n.SPEC_ACCEPTED_TOKENS, "accepted", ["algorithm"], registry=r)
        self.spec_length = Histogram(n.SPEC_ACCEPTANCE_LENGTH, "per verify", ["algorithm"], registry=r,
                                     buckets=[float(i) for i in range(1, 18)])
        build = Gauge(n.BUILD_INFO, "build", ["version", "model", "policy", "backend", "dtype", "quantization"],
                      registry=r)
        build.labels("0.1.0", "gemma3-270m", "memo", "torch", "bfloat16", "int8-head").set(1)
        for policy in n.POLICIES:
            self.translations.labels(policy)
            for path in n.PATHS:
                self.hits.labels(policy, path)
                for reason in n.MISS_REASONS:
                    self.misses.labels(policy, path, reason)
            for site in n.INVALIDATION_SITES:
                self.invalidations.labels(policy, site)
            for site in n.TRANSLATE_SITES:
                for cls in n.CLASSIFICATIONS:
                    if (site, cls) != ("kv_write", "stale_loc"):
                        self.events.labels(policy, site, cls)
        for mode in n.FORWARD_MODES:
            self.forwards.labels(mode)
            self.forward_seconds.labels(mode)
        for status in n.REQUEST_STATUSES:
            self.requests.labels(status)
        for kind in n.RETRACTION_KINDS:
            self.retractions.labels(kind)
        for direction in n.HICACHE_DIRECTIONS:
            self.host_bytes.labels(direction)
        for pool in n.KV_POOLS:
            self.prefix_tokens.labels(pool)
            self.prefix_evicted.labels(pool)
        for state in n.PREFIX_NODE_STATES:
            self.prefix_nodes.labels(state)
        for event in n.LOG_EVENT_NAMES:
            self.suppressed.labels(event)
        for pool, total in (("full", 16384), ("swa", 4096)):
            self.kv.labels(pool, "total").set(total)
        # Deliberately against the contract: one stale_loc series is born at 1, which increase() cannot
        # see. The alert must still fire on it (the `unless ... offset 5m` branch).
        self.events.labels("memo", "kv_write", "stale_loc").inc()
        self.step = 0

    def advance(self) -> None:
        """One scrape interval of steady memo decode traffic."""
        self.step += 1
        f = FORWARDS_PER_SCRAPE
        self.forwards.labels("graph_replay").inc(f)
        for _ in range(f):
            self.forward_seconds.labels("graph_replay").observe(0.012)
        self.hits.labels("memo", "graph_replay").inc(HITS_PER_FORWARD * f)
        self.misses.labels("memo", "graph_replay", "invalidated").inc(MISSES_PER_FORWARD * f)
        self.translations.labels("memo").inc(f)
        self.invalidations.labels("memo", "forward_entry").inc(f)
        self.invalidations.labels("memo", "alloc").inc(f)
        self.events.labels("memo", "window_indices", "benign_fresh_tensor").inc(1)
        self.evicted.inc(2 * f)
        self.prompt.inc(64)
        self.generated.inc(8 * f)
        self.requests.labels("finished").inc(1)
        self.ttft.observe(0.08)
        self.e2e.observe(0.9)
        for _ in range(f):
            self.itl.observe(0.015)
        if self.step % 5 == 0:
            self.offloads.inc()
            self.loadbacks.inc()
            self.retractions.labels("offload").inc()
            self.host_bytes.labels("offload").inc(1 << 20)
            self.host_bytes.labels("loadback").inc(1 << 19)
        # ngram speculation: 4-token drafts, half accepted; each verify emits 3 tokens
        self.spec_draft.labels("ngram").inc(4 * f)
        self.spec_accepted.labels("ngram").inc(2 * f)
        for _ in range(f):
            self.spec_length.labels("ngram").observe(3)
        # a multi-turn chat: 3 of every 4 prompt tokens were cached by an earlier turn
        self.prefix_queries.inc(64)
        self.prefix_hits.inc(48)
        self.prefix_evicted.labels("full").inc(16)
        self.prefix_evicted.labels("swa").inc(8)
        self.prefix_tokens.labels("full").set(4000 + self.step)
        self.prefix_tokens.labels("swa").set(512)
        self.prefix_nodes.labels("device").set(8)
        self.prefix_nodes.labels("tombstoned").set(20)
        self.prefix_nodes.labels("host").set(5)
        self.kv.labels("full", "used").set(2000 + 10 * self.step)
        self.kv.labels("full", "available").set(16384 - 2000 - 10 * self.step)
        self.kv.labels("swa", "used").set(1024)
        self.kv.labels("swa", "available").set(4096 - 1024)
        self.running.set(8)
        self.queued.set(2)

    def exposition(self) -> bytes:
        self.advance()
        return generate_latest(self.registry)


@pytest.fixture(scope="package")
def fake_runtime() -> Iterator[tuple[FakeRuntime, int]]:
    runtime = FakeRuntime()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            if self.path != "/metrics":
                self.send_error(404)
                return
            with lock:
                body = runtime.exposition()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    class QuietServer(ThreadingHTTPServer):
        def handle_error(self, request, client_address) -> None:
            # Prometheus hangs up on a scrape that outlives its timeout on a busy machine; the default prints a
            # traceback from this thread, and on Python 3.11 formatting one parses source (for its carets),
            # which races with an ast.parse in the main thread (gh-106905).
            if not isinstance(sys.exc_info()[1], ConnectionError):
                super().handle_error(request, client_address)

    server = QuietServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield runtime, server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="package")
def live_prometheus(tmp_path_factory, fake_runtime) -> Iterator[str]:
    """A real Prometheus on loopback scraping the fake runtime every second with our rule files."""
    _, exporter_port = fake_runtime
    proc, url = start_prometheus(tmp_path_factory.mktemp("prometheus"), f"127.0.0.1:{exporter_port}")
    try:
        # each rule group is evaluated on its own schedule: wait for every group the dashboard reads
        rules = ("swa_runtime:loc_cache_hit_ratio:rate5m", "swa_runtime:prefix_cache_hit_ratio:rate5m")
        wait_for(lambda: all(prom_query(url, rule) for rule in rules), 30, "recording rules with data")
        yield url
    finally:
        stop(proc)


@pytest.fixture
def promtool() -> str:
    """Path of promtool; skips the test when the binary is missing."""
    return promtool_path()


@pytest.fixture
def query():
    """`query(url, expr)` -> Prometheus instant-query result list."""
    return prom_query
