"""The scrape-time Prometheus collector: reads `EngineStats` and yields every metric of docs/metrics.md.

Names come from `telemetry.names`. Counter names there end in `_total`; `CounterMetricFamily` strips the
suffix from the family name and puts it back on the sample, so the exposed samples are exactly the names in
the table (`swa_runtime_loc_cache_hits_total{...}`).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from telemetry import names
from telemetry.stats import EngineStats, FrontEndStats, PlainHistogram, TranslationStats


class TelemetryCollector:
    """A custom collector: no state of its own, every value is read from `stats` when Prometheus scrapes."""

    def __init__(self, stats: EngineStats):
        self._stats = stats
        # Non-active policies are exposed at 0 so that per-policy queries and dashboards always find a series.
        self._idle = {p: TranslationStats(p) for p in names.POLICIES}

    def collect(self) -> Iterator[Metric]:
        yield from self._translation()
        yield from self._forwards()
        yield from self._kv()
        yield from self._prefix_cache()
        yield from self._requests()
        yield from self._speculative()
        yield from self._logging_and_build()

    def _policies(self) -> Iterator[TranslationStats]:
        active = self._stats.translation
        for policy in names.POLICIES:
            yield active if policy == active.policy else self._idle[policy]

    def _translation(self) -> Iterator[Metric]:
        hits = CounterMetricFamily(
            names.LOC_CACHE_HITS,
            "Translation cache lookups that returned the cached value.",
            labels=["policy", "path"],
        )
        misses = CounterMetricFamily(
            names.LOC_CACHE_MISSES,
            "Translation cache lookups that recomputed, by reason.",
            labels=["policy", "path", "reason"],
        )
        invalidations = CounterMetricFamily(
            names.LOC_CACHE_INVALIDATIONS,
            "Translation cache invalidations, by mutation or lifecycle site.",
            labels=["policy", "site"],
        )
        events = CounterMetricFamily(
            names.LOC_KEY_CHANGE_EVENTS,
            "Classified key-change events at translate call sites; every class but benign_fresh_tensor is a bug.",
            labels=["policy", "site", "classification"],
        )
        translations = CounterMetricFamily(
            names.LOC_TRANSLATIONS, "Full-to-SWA location gathers actually executed.", labels=["policy"]
        )
        for t in self._policies():
            p = t.policy
            for path, n in t.hit_counts.items():
                hits.add_metric([p, path], n)
            for (path, reason), n in t.miss_counts.items():
                misses.add_metric([p, path, reason], n)
            for site, n in t.invalidation_counts.items():
                invalidations.add_metric([p, site], n)
            for (site, classification), n in t.key_change_counts.items():
                events.add_metric([p, site, classification], n)
            translations.add_metric([p], t.translation_count)
        yield from (hits, misses, invalidations, events, translations)

    def _forwards(self) -> Iterator[Metric]:
        s = self._stats
        total = CounterMetricFamily(names.FORWARD_TOTAL, "Model forwards, by mode.", labels=["mode"])
        seconds = HistogramMetricFamily(
            names.FORWARD_SECONDS, "Model forward wall time in seconds, by mode.", labels=["mode"], unit="seconds"
        )
        for mode, n in s.forward_counts.items():
            total.add_metric([mode], n)
            _add_histogram(seconds, [mode], s.forward_seconds[mode])
        yield from (total, seconds)

    def _kv(self) -> Iterator[Metric]:
        s = self._stats
        # Only the contract's (pool, state) pairs are exposed; others from the callback are ignored, since
        # gauges from unknown pools cannot be meaningfully summed into `other`.
        reported = s.gauges.kv_tokens()
        kv = GaugeMetricFamily(names.KV_TOKENS, "KV pool slots by pool and state.", labels=["pool", "state"])
        for pool in names.KV_POOLS:
            for state in names.KV_STATES:
                kv.add_metric([pool, state], reported.get((pool, state), 0))
        yield kv
        yield _counter(
            names.SWA_EVICTED_TOKENS, "Tokens whose SWA slots were freed on leaving the window.", s.swa_evicted_tokens
        )
        yield _counter(names.HICACHE_OFFLOADS, "Requests whose KV was offloaded to host memory.", s.hicache_offloads)
        yield _counter(
            names.HICACHE_LOADBACKS, "Requests whose KV was loaded back from host memory.", s.hicache_loadbacks
        )
        retractions = CounterMetricFamily(
            names.RETRACTIONS, "Running requests taken off the device under pool pressure, by kind.", labels=["kind"]
        )
        for kind, n in s.retraction_counts.items():
            retractions.add_metric([kind], n)
        yield retractions
        traffic = CounterMetricFamily(
            names.HICACHE_BYTES, "Bytes of KV copied between the device and the host tier, by direction.",
            labels=["direction"],
        )
        for direction, n in s.hicache_bytes.items():
            traffic.add_metric([direction], n)
        yield traffic

    def _prefix_cache(self) -> Iterator[Metric]:
        p = self._stats.prefix_cache
        yield _counter(names.PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache.", p.queried_tokens)
        yield _counter(names.PREFIX_CACHE_HITS, "Prompt tokens found in the prefix cache (not prefilled).",
                       p.hit_tokens)
        cached = GaugeMetricFamily(
            names.PREFIX_CACHE_TOKENS, "Device slots the prefix cache holds, by pool.", labels=["pool"]
        )
        evicted = CounterMetricFamily(
            names.PREFIX_CACHE_EVICTED_TOKENS,
            "Slots the prefix cache freed under pressure, by pool (full: nodes sent to the host tier or dropped; "
            "swa: SWA sides tombstoned or evicted with their node).",
            labels=["pool"],
        )
        for pool in names.KV_POOLS:
            cached.add_metric([pool], p.cached_tokens[pool])
            evicted.add_metric([pool], p.evicted_tokens[pool])
        nodes = GaugeMetricFamily(
            names.PREFIX_CACHE_NODES,
            "Prefix-cache nodes by state: device (full and SWA KV), tombstoned (full KV only), host (host tier).",
            labels=["state"],
        )
        for state in names.PREFIX_NODE_STATES:
            nodes.add_metric([state], p.nodes[state])
        yield from (cached, evicted, nodes)

    def _requests(self) -> Iterator[Metric]:
        s = self._stats
        requests = CounterMetricFamily(names.REQUESTS_TOTAL, "Requests by final status.", labels=["status"])
        for status, n in s.request_counts.items():
            requests.add_metric([status], n)
        yield requests
        yield _counter(names.PROMPT_TOKENS, "Prompt tokens processed.", s.prompt_tokens)
        yield _counter(names.GENERATION_TOKENS, "Tokens generated.", s.generation_tokens)
        for name, doc, hist in (
            (names.TIME_TO_FIRST_TOKEN, "Time to first token in seconds.", s.ttft),
            (names.INTER_TOKEN_LATENCY, "Time between consecutive output tokens in seconds.", s.itl),
            (names.E2E_REQUEST_LATENCY, "Request latency from arrival to finish in seconds.", s.e2e),
        ):
            family = HistogramMetricFamily(name, doc, labels=[], unit="seconds")
            _add_histogram(family, [], hist)
            yield family
        running, queued = s.gauges.queue_sizes()
        yield GaugeMetricFamily(names.NUM_RUNNING_REQS, "Requests in the running batch.", value=running)
        yield GaugeMetricFamily(names.NUM_QUEUE_REQS, "Requests waiting to be scheduled.", value=queued)

    def _speculative(self) -> Iterator[Metric]:
        yield from _spec_families(self._stats.spec)

    def _logging_and_build(self) -> Iterator[Metric]:
        s = self._stats
        suppressed = CounterMetricFamily(
            names.LOG_EVENTS_SUPPRESSED, "Log records dropped by the rate limiter, by event.", labels=["event"]
        )
        for event, n in s.suppressed_counts.items():
            suppressed.add_metric([event], n)
        yield suppressed
        b = s.build_info
        info = GaugeMetricFamily(
            names.BUILD_INFO, "Build and configuration; always 1.", labels=["version", "model", "policy", "backend", "dtype", "quantization"]
        )
        info.add_metric([b.version, b.model, b.policy, b.backend, b.dtype, b.quantization], 1)
        yield info


class FrontEndCollector:
    """The serving process's own series (engine up, engine restarts, HTTP answers by code), read from
    `FrontEndStats` at scrape time: a scrape answers with these even while the engine process is down."""

    def __init__(self, stats: FrontEndStats):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats
        yield GaugeMetricFamily(names.ENGINE_UP, "1 while the engine process is alive and answers its heartbeat.",
                                value=1 if s.engine_up() else 0)
        yield _counter(names.ENGINE_RESTARTS, "Engine processes restarted by the front end after one died or hung.",
                       s.engine_restarts)
        responses = CounterMetricFamily(names.HTTP_RESPONSES, "HTTP answers of the front end, by status code "
                                        "(refusals before the engine included).", labels=["code"])
        for code, n in s.http_responses.items():
            responses.add_metric([code], n)
        yield responses


def _counter(name: str, doc: str, value: int) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _spec_families(spec) -> Iterator[Metric]:
    draft = CounterMetricFamily(names.SPEC_DRAFT_TOKENS, "Draft tokens proposed for verification, by algorithm.",
                                labels=["algorithm"])
    accepted = CounterMetricFamily(names.SPEC_ACCEPTED_TOKENS, "Draft tokens the target model accepted, by "
                                   "algorithm (rejected = proposed - accepted).", labels=["algorithm"])
    length = HistogramMetricFamily(names.SPEC_ACCEPTANCE_LENGTH, "Tokens one verify forward emitted for a "
                                   "request: accepted draft tokens plus the target's own.", labels=["algorithm"])
    for algorithm in names.SPEC_ALGORITHMS:
        draft.add_metric([algorithm], spec.draft_tokens[algorithm])
        accepted.add_metric([algorithm], spec.accepted_tokens[algorithm])
        _add_histogram(length, [algorithm], spec.acceptance_length[algorithm])
    yield draft
    yield accepted
    yield length


def _add_histogram(family: HistogramMetricFamily, labels: list[str], hist: PlainHistogram) -> None:
    snap = hist.snapshot()
    buckets = [(floatToGoString(bound), n) for bound, n in snap.buckets]
    family.add_metric(labels, buckets, sum_value=snap.sum)


def make_registry(stats: EngineStats, *, process_collectors: bool = False) -> CollectorRegistry:
    """A fresh registry holding only our collector (plus process/platform/GC collectors when asked)."""
    registry = process_registry() if process_collectors else CollectorRegistry()
    registry.register(TelemetryCollector(stats))
    return registry


def process_registry(front_end: FrontEndStats | None = None) -> CollectorRegistry:
    """A fresh registry of this process's own collectors (CPU, memory, file descriptors, platform, GC), and
    the front end's series when `front_end` is given."""
    from prometheus_client import GCCollector, PlatformCollector, ProcessCollector

    registry = CollectorRegistry()
    if front_end is not None:
        registry.register(FrontEndCollector(front_end))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry
