"""Hot-path counters as plain Python ints; the collector reads them at scrape time (docs/metrics.md).

A `prometheus_client` Counter takes a lock per increment; here an increment is a dict lookup and `+= 1`.
Every label combination is created at 0 up front, so every series exists from start-up (a counter born at 1
is invisible to `increase()`) and no dict ever changes size after construction, which lets a scrape iterate
them from another thread while the engine counts. Unknown label values fold to `other`, but only after the
fast lookup failed.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from itertools import product
from typing import NamedTuple, Protocol

from telemetry import names
from telemetry.names import fold

FORWARD_SECONDS_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
# Shared by TTFT (tens of ms to seconds), inter-token latency (ms) and end-to-end latency (up to minutes).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip


class TranslationStats:
    """Counters of one translation policy: lookups by path, misses by reason, invalidations, events, gathers."""

    __slots__ = (
        "policy",
        "hit_counts",
        "miss_counts",
        "invalidation_counts",
        "key_change_counts",
        "translation_count",
    )

    def __init__(self, policy: str):
        if policy not in names.POLICIES:
            raise ValueError(f"unknown translation policy {policy!r}; expected one of {names.POLICIES}")
        self.policy = policy
        self.hit_counts: dict[str, int] = dict.fromkeys(names.PATH_LABELS, 0)
        self.miss_counts: dict[tuple[str, str], int] = dict.fromkeys(
            product(names.PATH_LABELS, names.MISS_REASON_LABELS), 0
        )
        self.invalidation_counts: dict[str, int] = dict.fromkeys(names.INVALIDATION_SITE_LABELS, 0)
        self.key_change_counts: dict[tuple[str, str], int] = dict.fromkeys(
            product(names.TRANSLATE_SITE_LABELS, names.CLASSIFICATION_LABELS), 0
        )
        self.translation_count = 0

    def hit(self, path: str) -> None:
        try:
            self.hit_counts[path] += 1
        except KeyError:
            self.hit_counts[fold(path, names.PATH_LABELS)] += 1

    def miss(self, path: str, reason: str) -> None:
        try:
            self.miss_counts[path, reason] += 1
        except KeyError:
            self.miss_counts[fold(path, names.PATH_LABELS), fold(reason, names.MISS_REASON_LABELS)] += 1

    def invalidation(self, site: str) -> None:
        try:
            self.invalidation_counts[site] += 1
        except KeyError:
            self.invalidation_counts[fold(site, names.INVALIDATION_SITE_LABELS)] += 1

    def key_change(self, site: str, classification: str) -> None:
        try:
            self.key_change_counts[site, classification] += 1
        except KeyError:
            key = (fold(site, names.TRANSLATE_SITE_LABELS), fold(classification, names.CLASSIFICATION_LABELS))
            self.key_change_counts[key] += 1

    def translations(self, n: int = 1) -> None:
        """Count gathers actually executed (the cost every policy pays on a miss)."""
        self.translation_count += n


class PrefixCacheStats:
    """The prefix cache's numbers. Counters: prompt tokens looked up and found cached (at admission), tokens
    whose slots the cache freed under pressure, by pool (`full`: a node evicted to the host tier or dropped;
    `swa`: a node's SWA side tombstoned or evicted with it). Gauges, kept current by the tree on every change
    (so that a scrape reads ints, never the tree): device tokens it holds by pool, and its nodes by state."""

    __slots__ = ("queried_tokens", "hit_tokens", "evicted_tokens", "cached_tokens", "nodes")

    def __init__(self):
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted_tokens: dict[str, int] = dict.fromkeys(names.KV_POOLS, 0)
        self.cached_tokens: dict[str, int] = dict.fromkeys(names.KV_POOLS, 0)
        self.nodes: dict[str, int] = dict.fromkeys(names.PREFIX_NODE_STATES, 0)

    def record_lookup(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit


# Tokens a verify forward emits for one request: the accepted draft tokens plus the target's own (1..K+1).
ACCEPTANCE_LENGTH_BUCKETS = tuple(float(n) for n in range(1, 18))


class SpecStats:
    """Speculative decoding per algorithm: draft tokens proposed and accepted (rejected = the difference),
    and tokens emitted per request per verify forward."""

    __slots__ = ("draft_tokens", "accepted_tokens", "acceptance_length")

    def __init__(self):
        self.draft_tokens: dict[str, int] = dict.fromkeys(names.SPEC_ALGORITHMS, 0)
        self.accepted_tokens: dict[str, int] = dict.fromkeys(names.SPEC_ALGORITHMS, 0)
        self.acceptance_length = {a: PlainHistogram(ACCEPTANCE_LENGTH_BUCKETS) for a in names.SPEC_ALGORITHMS}

    def record_verify(self, algorithm: str, drafted: int, accepted: int) -> None:
        """One request's verify: `drafted` tokens proposed, `accepted` of them kept (plus the target's own)."""
        if algorithm not in self.draft_tokens:
            return  # `none` never verifies; an unknown name has no series to count in
        self.draft_tokens[algorithm] += drafted
        self.accepted_tokens[algorithm] += accepted
        self.acceptance_length[algorithm].observe(accepted + 1)


class HistogramSnapshot(NamedTuple):
    buckets: tuple[tuple[float, int], ...]  # (upper bound, cumulative count), ending with (+inf, count)
    count: int
    sum: float


class PlainHistogram:
    """A fixed-bucket histogram: one bisect and two additions per observation, no lock."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, buckets: Iterable[float]):
        bounds = tuple(float(b) for b in buckets if b != math.inf)
        if not bounds or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"buckets must be non-empty and strictly increasing, got {bounds}")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left puts a value equal to a bound in that bound's bucket: Prometheus buckets are `le`.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> HistogramSnapshot:
        """Cumulative buckets for exposition (copied first, so buckets and count always agree)."""
        counts = self.counts[:]
        total = self.sum
        cumulative = []
        running = 0
        for bound, n in zip((*self.bounds, math.inf), counts):
            running += n
            cumulative.append((bound, running))
        return HistogramSnapshot(tuple(cumulative), running, total)


@dataclass(frozen=True, slots=True)
class BuildInfo:
    version: str
    model: str
    policy: str
    backend: str
    dtype: str  # what runs, `auto` resolved (a closed set: the engine's DTYPES)
    quantization: str


def _package_version() -> str:
    try:
        return metadata.version("swa-runtime")
    except metadata.PackageNotFoundError:
        return "unknown"


class GaugeSource(Protocol):
    """What the engine exposes for the gauges, read at scrape time."""

    def kv_tokens(self) -> dict[tuple[str, str], int]: ...

    def queue_sizes(self) -> tuple[int, int]: ...


class NoGauges:
    """Reads 0 everywhere: an engine not built yet, or a test of the counters alone."""

    def kv_tokens(self) -> dict[tuple[str, str], int]:
        return {}

    def queue_sizes(self) -> tuple[int, int]:
        return (0, 0)


class EngineStats:
    """Everything the engine counts, in one object that the collector reads at scrape time.

    Gauges are not pushed: the `gauges` source given at construction is asked per scrape
    (`kv_tokens() -> {(pool, state): n}`, `queue_sizes() -> (running, queued)`); without one they read 0.
    """

    def __init__(
        self,
        policy: str = "memo",
        *,
        model: str = "unknown",
        backend: str = "unknown",
        version: str | None = None,
        gauges: GaugeSource | None = None,
        dtype: str = "unknown",
        quantization: str = "unknown",
    ):
        self.translation = TranslationStats(policy)
        self.forward_counts: dict[str, int] = dict.fromkeys(names.FORWARD_MODE_LABELS, 0)
        self.forward_seconds = {m: PlainHistogram(FORWARD_SECONDS_BUCKETS) for m in names.FORWARD_MODE_LABELS}
        self.swa_evicted_tokens = 0
        self.hicache_offloads = 0
        self.hicache_loadbacks = 0
        self.retraction_counts: dict[str, int] = dict.fromkeys(names.RETRACTION_KIND_LABELS, 0)
        self.hicache_bytes: dict[str, int] = dict.fromkeys(names.HICACHE_DIRECTION_LABELS, 0)
        self.prefix_cache = PrefixCacheStats()
        self.spec = SpecStats()
        self.request_counts: dict[str, int] = dict.fromkeys(names.REQUEST_STATUS_LABELS, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = PlainHistogram(LATENCY_BUCKETS)
        self.itl = PlainHistogram(LATENCY_BUCKETS)
        self.e2e = PlainHistogram(LATENCY_BUCKETS)
        self.suppressed_counts: dict[str, int] = dict.fromkeys(names.LOG_EVENT_LABELS, 0)
        self.gauges: GaugeSource = gauges if gauges is not None else NoGauges()
        self.build_info = BuildInfo(
            version=version if version is not None else _package_version(),
            model=model,
            policy=policy,
            backend=backend,
            dtype=dtype,
            quantization=quantization,
        )

    def record_forward(self, mode: str, seconds: float) -> None:
        if mode not in self.forward_counts:
            mode = fold(mode, names.FORWARD_MODE_LABELS)
        self.forward_counts[mode] += 1
        self.forward_seconds[mode].observe(seconds)

    def record_request(self, status: str) -> None:
        try:
            self.request_counts[status] += 1
        except KeyError:
            self.request_counts[fold(status, names.REQUEST_STATUS_LABELS)] += 1

    def add_prompt_tokens(self, n: int) -> None:
        self.prompt_tokens += n

    def add_generation_tokens(self, n: int) -> None:
        self.generation_tokens += n

    def add_evicted_tokens(self, n: int) -> None:
        self.swa_evicted_tokens += n

    def add_hicache_offloads(self, n: int = 1) -> None:
        self.hicache_offloads += n

    def add_hicache_loadbacks(self, n: int = 1) -> None:
        self.hicache_loadbacks += n

    def add_hicache_bytes(self, direction: str, n: int) -> None:
        try:
            self.hicache_bytes[direction] += n
        except KeyError:
            self.hicache_bytes[fold(direction, names.HICACHE_DIRECTION_LABELS)] += n

    def record_retraction(self, kind: str) -> None:
        try:
            self.retraction_counts[kind] += 1
        except KeyError:
            self.retraction_counts[fold(kind, names.RETRACTION_KIND_LABELS)] += 1

    def log_suppressed(self, event: str) -> None:
        try:
            self.suppressed_counts[event] += 1
        except KeyError:
            self.suppressed_counts[fold(event, names.LOG_EVENT_LABELS)] += 1


class FrontEndStats:
    """What the serving process counts itself, so that it exists while the engine process is down: whether
    the engine answers (`engine_up`, a callable read at scrape time), how often it was restarted, and every
    HTTP answer by status code (refusals the engine never sees included). Counted on the event loop and
    the supervisor thread only, each its own field."""

    def __init__(self, engine_up: Callable[[], bool] = lambda: True):
        self.engine_up = engine_up
        self.engine_restarts = 0
        self.http_responses: dict[str, int] = dict.fromkeys(names.HTTP_CODE_LABELS, 0)

    def record_response(self, code: int) -> None:
        key = str(code)
        try:
            self.http_responses[key] += 1
        except KeyError:
            self.http_responses[fold(key, names.HTTP_CODE_LABELS)] += 1


class NullTranslationStats(TranslationStats):
    """Counts nothing: what `--no-telemetry` runs with, so benchmarks can measure what counting costs."""

    __slots__ = ()

    def hit(self, path: str) -> None:
        pass

    def miss(self, path: str, reason: str) -> None:
        pass

    def invalidation(self, site: str) -> None:
        pass

    def key_change(self, site: str, classification: str) -> None:
        pass

    def translations(self, n: int = 1) -> None:
        pass
