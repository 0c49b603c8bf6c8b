"""The swa-runtime Grafana dashboard, as code: rows, panels, queries, variables (docs/metrics.md).

Queries are written against telemetry/names.py and the recording rules; `python -m dashboards.generate`
renders this to JSON and `--check` proves the committed JSON matches and names only known metrics.
Every rate uses $__rate_interval and every selector filters on the `job` and `instance` variables.
"""

from __future__ import annotations

from typing import Any

from dashboards.panels import layout, row, stat, table, target, timeseries
from telemetry import names as n

DASHBOARD_UID = "swa-runtime-loc-cache"
DATASOURCE_UID = "swa-prometheus"  # grafana/provisioning/datasources/prometheus.yml uses the same uid
SCHEMA_VERSION = 41  # classic dashboard model of Grafana 12.0 (the image pinned in docker-compose.yml)

SEL = 'job=~"$job", instance=~"$instance"'
RATE = "$__rate_interval"
NON_BENIGN = 'classification!="benign_fresh_tensor"'
SANITIZER = f'classification=~"{"|".join(n.SANITIZER_CLASSIFICATIONS)}"'  # the KV sanitizer's classes
USED, TOTAL = 'state="used"', 'state="total"'
PREFIX_SITES = 'site=~"prefix_.+"'  # the prefix cache's invalidation sites

# Alert levels drawn on the panels they belong to (keep in step with prometheus/rules/alerts.yml).
HIT_RATIO_ALERT = 0.5
INVALIDATIONS_PER_FORWARD_ALERT = 32
KV_PRESSURE_ALERT = 0.95


def sel(extra: str = "") -> str:
    return "{" + SEL + (", " + extra if extra else "") + "}"


def rate(metric: str, extra: str = "") -> str:
    return f"rate({metric}{sel(extra)}[{RATE}])"


def quantiles(metric: str, label: str, qs: tuple[float, ...] = (0.5, 0.95, 0.99)) -> list[dict[str, Any]]:
    by = "le" + (f", {label}" if label else "")
    suffix = f" {{{{{label}}}}}" if label else ""
    return [
        target(f"histogram_quantile({q}, sum by ({by}) ({rate(metric + '_bucket')}))", f"p{int(q * 100)}{suffix}")
        for q in qs
    ]


def _steps(*levels: tuple[str, float | None]) -> list[dict[str, Any]]:
    return [{"color": color, "value": value} for color, value in levels]


def translation_cache() -> list[dict[str, Any]]:
    hits, misses = n.LOC_CACHE_HITS, n.LOC_CACHE_MISSES
    ratio = (
        f"sum by (policy) ({rate(hits)})\n/\n"
        f"(sum by (policy) ({rate(hits)}) + sum by (policy) ({rate(misses)}) > 0)"
    )
    return [
        row("Translation cache"),
        timeseries(
            "Hit ratio",
            "Translation-cache hits / (hits + misses) per policy. A healthy memo or layerwise cache misses "
            "once per translate site per forward (right after the forward-entry invalidation) and hits on "
            "every other sliding layer. per_forward and off keep no entries and show no ratio.",
            "percentunit",
            [target(ratio, "{{policy}}")],
            min_=0,
            max_=1,
            thresholds=_steps(("red", None), ("green", HIT_RATIO_ALERT)),
        ),
        stat(
            "Hit ratio (5m, as alerted)",
            "The recording rule swa_runtime:loc_cache_hit_ratio:rate5m that SWARuntimeLocCacheHitRatioLow "
            f"evaluates; red below {HIT_RATIO_ALERT:.0%}.",
            "percentunit",
            [target(f"swa_runtime:loc_cache_hit_ratio:rate5m{sel()}", "{{instance}} {{policy}}")],
            min_=0,
            max_=1,
            thresholds=_steps(("red", None), ("green", HIT_RATIO_ALERT)),
        ),
        table(
            "Build",
            "swa_runtime_build_info of each selected instance: version, model, translation policy "
            "(--loc-cache) and attention backend.",
            "none",
            [target(f"{n.BUILD_INFO}{sel()}", "", instant=True, table=True)],
            hide=("Time", "Value", "__name__", "job"),
        ),
        timeseries(
            "Lookups by result",
            "Translation-cache lookups per second, hits vs misses, summed over policies and paths.",
            "ops",
            [target(f"sum({rate(hits)})", "hits"), target(f"sum({rate(misses)})", "misses")],
        ),
        timeseries(
            "Misses by reason",
            "Misses per second by reason: cold (first fill), invalidated (an invalidation emptied the "
            "entry), key_changed (another tensor or view), stale_guard (buffer or mapping changed without "
            "invalidation), capture (graph capture refilled a warm-up entry).",
            "ops",
            [target(f"sum by (reason) ({rate(misses)})", "{{reason}}")],
            stack=True,
        ),
        timeseries(
            "Gathers executed",
            "Translations actually computed (one gather each) per second by policy. memo and layerwise "
            "should do about one per forward and translate site; off does one per sliding layer.",
            "ops",
            [target(f"sum by (policy) ({rate(n.LOC_TRANSLATIONS)})", "{{policy}}")],
        ),
    ]


def invalidation_and_events() -> list[dict[str, Any]]:
    inv, events = n.LOC_CACHE_INVALIDATIONS, n.LOC_KEY_CHANGE_EVENTS
    return [
        row("Invalidations and key-change events"),
        timeseries(
            "Invalidations by site",
            "Cache invalidations per second by site: allocator and mapping mutations (alloc, free, "
            "free_swa, clear, set_mapping, clear_swa_mapping, register_mapping; the prefix cache's "
            "prefix_evict, prefix_tombstone, prefix_loadback), lifecycle points "
            "(forward_entry, graph_capture) and explicit calls without a site (manual).",
            "ops",
            [target(f"sum by (site) ({rate(inv)})", "{{site}}")],
            stack=True,
        ),
        timeseries(
            "Invalidations per forward",
            "All invalidations divided by forwards. By design about 1 to 4 (one at forward entry plus the "
            f"allocator calls of the step); the dashed line is the SWARuntimeInvalidationStorm level "
            f"({INVALIDATIONS_PER_FORWARD_ALERT}).",
            "none",
            [target(f"sum({rate(inv)})\n/\n(sum({rate(n.FORWARD_TOTAL)}) > 0)", "invalidations per forward")],
            min_=0,
            thresholds=_steps(("green", None), ("red", INVALIDATIONS_PER_FORWARD_ALERT)),
        ),
        timeseries(
            "Key-change events by classification",
            "Classified key-change events per second. benign_fresh_tensor is expected; view_offset, "
            "cross_forward, stale_loc and capture_pollution are bugs and alert, as do the KV sanitizer's "
            "foreign_slot_write, foreign_slot_read and freed_slot_read.",
            "ops",
            [target(f"sum by (classification) ({rate(events)})", "{{classification}}")],
        ),
        table(
            "Top key-change sites over the range",
            "Key-change events in the selected time range by translate site and classification, largest "
            "first (top 10). Pair a non-benign row with the loc_key_change WARNING log of the same site "
            "and classification for the stack.",
            "short",
            [
                target(
                    f"topk(10, sum by (site, classification) (increase({events}{sel()}[$__range])))",
                    "",
                    instant=True,
                    table=True,
                )
            ],
            hide=("Time",),
        ),
        timeseries(
            "Non-benign events by site",
            "Non-benign key-change events per second by translate site and classification.",
            "ops",
            [
                target(
                    f"sum by (site, classification) ({rate(events, NON_BENIGN)})",
                    "{{site}} {{classification}}",
                )
            ],
        ),
        timeseries(
            "KV ownership violations (sanitizer)",
            "KV sanitizer events per second by site and classification: foreign_slot_write (a KV write into a "
            "slot its token does not own, e.g. graph padding), foreign_slot_read (attention read a slot of "
            "another request or position), freed_slot_read (a freed or tombstoned slot read). Any value above "
            "0 means corrupted outputs: the loc_key_change WARNING log names the slot, its owners and the code "
            "path that last allocated, freed or moved it (docs/kv-sanitizer.md).",
            "ops",
            [target(f"sum by (site, classification) ({rate(events, SANITIZER)})", "{{site}} {{classification}}")],
        ),
        timeseries(
            "Suppressed log events",
            "Structured-log events dropped by the per-(site, classification) rate limiter, per second. "
            "The counters above still count every event.",
            "ops",
            [target(f"sum by (event) ({rate(n.LOG_EVENTS_SUPPRESSED)})", "{{event}}")],
        ),
    ]


def forwards() -> list[dict[str, Any]]:
    return [
        row("Forwards"),
        timeseries(
            "Forwards by mode",
            "Model forwards per second by mode: eager_extend, eager_decode, graph_capture, graph_replay.",
            "ops",
            [target(f"sum by (mode) ({rate(n.FORWARD_TOTAL)})", "{{mode}}")],
            width=12,
            stack=True,
        ),
        timeseries(
            "Forward latency",
            "Forward duration quantiles (p50, p95) by mode from the swa_runtime_forward_seconds histogram.",
            "s",
            quantiles(n.FORWARD_SECONDS, "mode", (0.5, 0.95)),
            width=12,
        ),
    ]


def kv_memory() -> list[dict[str, Any]]:
    kv = n.KV_TOKENS
    return [
        row("KV memory"),
        timeseries(
            "KV usage: full vs SWA",
            "Used / total slots of the full pool and the SWA pool (reserved slots excluded, so an idle "
            f"engine reads 0). The dashed line is the SWARuntimeKVPoolPressure level ({KV_PRESSURE_ALERT:.0%}).",
            "percentunit",
            [
                target(
                    f"sum by (pool) ({kv}{sel(USED)})\n/\n(sum by (pool) ({kv}{sel(TOTAL)}) > 0)",
                    "{{pool}}",
                )
            ],
            min_=0,
            max_=1,
            thresholds=_steps(("green", None), ("red", KV_PRESSURE_ALERT)),
        ),
        timeseries(
            "KV tokens by pool and state",
            "Token slots per pool: used (held by requests), available, total.",
            "short",
            [target(f"sum by (pool, state) ({kv}{sel()})", "{{pool}} {{state}}")],
        ),
        timeseries(
            "SWA evictions and host-cache traffic",
            "Tokens per second whose SWA slots were freed after leaving every request's window, and "
            "host-cache (HiCache) offloads and load-backs per second.",
            "ops",
            [
                target(f"sum({rate(n.SWA_EVICTED_TOKENS)})", "SWA tokens evicted"),
                target(f"sum({rate(n.HICACHE_OFFLOADS)})", "offloads"),
                target(f"sum({rate(n.HICACHE_LOADBACKS)})", "loadbacks"),
            ],
        ),
        timeseries(
            "Retractions by kind",
            "Running requests taken off the device per second because the pools ran out: offloaded to the host "
            "tier, or dropped to be recomputed (prefill paid again). A steady rate means the pools are too small "
            "for the concurrency admitted.",
            "ops",
            [target(f"sum by (kind) ({rate(n.RETRACTIONS)})", "{{kind}}")],
        ),
    ]


def prefix_cache() -> list[dict[str, Any]]:
    hits, queries = n.PREFIX_CACHE_HITS, n.PREFIX_CACHE_QUERIES
    return [
        row("Prefix cache"),
        timeseries(
            "Prefix-cache hit rate",
            "Prompt tokens found in the prefix cache / prompt tokens looked up (both counted at admission). A chat "
            "that resends its conversation should read well above 0; cached tokens are not prefilled again.",
            "percentunit",
            [target(f"sum({rate(hits)})\n/\n(sum({rate(queries)}) > 0)", "hit rate")],
            min_=0,
            max_=1,
        ),
        stat(
            "Prefix-cache hit rate (5m)",
            "The recording rule swa_runtime:prefix_cache_hit_ratio:rate5m per instance.",
            "percentunit",
            [target(f"swa_runtime:prefix_cache_hit_ratio:rate5m{sel()}", "{{instance}}")],
            min_=0,
            max_=1,
        ),
        timeseries(
            "Prefix-cache tokens by pool",
            "Device slots the prefix cache holds: full-pool KV of every cached prefix, SWA KV only for the last "
            "window of each (older SWA slots are freed and their nodes tombstoned). Unlocked ones count as "
            "available in the KV panels: eviction frees them on demand.",
            "short",
            [target(f"sum by (pool) ({n.PREFIX_CACHE_TOKENS}{sel()})", "{{pool}}")],
        ),
        timeseries(
            "Prefix-cache nodes by state",
            "Radix-tree nodes: device (full and SWA KV), tombstoned (full KV only; still serves longer prefixes "
            "through it), host (evicted to the host tier, loaded back on a later match).",
            "short",
            [target(f"sum by (state) ({n.PREFIX_CACHE_NODES}{sel()})", "{{state}}")],
            stack=True,
        ),
        timeseries(
            "Prefix-cache evictions by pool",
            "Slots per second the prefix cache freed under pool pressure, least recently used first: full "
            "(nodes sent to the host tier or dropped) and swa (SWA sides tombstoned or evicted with their node).",
            "short",
            [target(f"sum by (pool) ({rate(n.PREFIX_CACHE_EVICTED_TOKENS)})", "{{pool}}")],
        ),
        timeseries(
            "Host-tier traffic by direction",
            "Bytes per second of KV copied to host memory (offload: retracted requests and evicted prefix-cache "
            "nodes) and back into new device slots (loadback: each registers a rebuilt mapping).",
            "Bps",
            [target(f"sum by (direction) ({rate(n.HICACHE_BYTES)})", "{{direction}}")],
        ),
        timeseries(
            "Prefix-cache mapping mutations",
            "Translation-cache invalidations per second at the prefix cache's mutation sites: prefix_evict (a "
            "node's slots freed), prefix_tombstone (its SWA side freed), prefix_loadback (a rebuilt mapping "
            "registered after a load-back from the host tier).",
            "ops",
            [target(f"sum by (site) ({rate(n.LOC_CACHE_INVALIDATIONS, PREFIX_SITES)})", "{{site}}")],
        ),
    ]


def requests() -> list[dict[str, Any]]:
    return [
        row("Requests"),
        timeseries(
            "Time to first token",
            "TTFT quantiles (p50, p95, p99) from swa_runtime_time_to_first_token_seconds.",
            "s",
            quantiles(n.TIME_TO_FIRST_TOKEN, ""),
        ),
        timeseries(
            "Inter-token latency",
            "Inter-token latency quantiles (p50, p95, p99) from swa_runtime_inter_token_latency_seconds.",
            "s",
            quantiles(n.INTER_TOKEN_LATENCY, ""),
        ),
        timeseries(
            "End-to-end request latency",
            "End-to-end request latency quantiles (p50, p95, p99) from swa_runtime_e2e_request_latency_seconds.",
            "s",
            quantiles(n.E2E_REQUEST_LATENCY, ""),
        ),
        timeseries(
            "Token throughput",
            "Prompt tokens processed and tokens generated per second.",
            "suffix: tok/s",
            [
                target(f"sum({rate(n.PROMPT_TOKENS)})", "prompt"),
                target(f"sum({rate(n.GENERATION_TOKENS)})", "generation"),
            ],
        ),
        timeseries(
            "Requests by status",
            "Requests ending per second by status: finished; aborted (client hang-up or shutdown); rejected "
            "(invalid); refused (429: the waiting queue was full); error (the engine failed them).",
            "reqps",
            [target(f"sum by (status) ({rate(n.REQUESTS_TOTAL)})", "{{status}}")],
            stack=True,
        ),
        timeseries(
            "Running and queued requests",
            "Requests in the running batch and waiting in the queue.",
            "short",
            [
                target(f"sum({n.NUM_RUNNING_REQS}{sel()})", "running"),
                target(f"sum({n.NUM_QUEUE_REQS}{sel()})", "queued"),
            ],
        ),
    ]


def speculative() -> list[dict[str, Any]]:
    return [
        row("Speculative decoding"),
        timeseries(
            "Draft acceptance rate",
            "Draft tokens the target model accepted / draft tokens proposed, by algorithm "
            "(--speculative-algorithm). Low acceptance makes requests back off from drafting; nothing is drawn "
            "while speculation is off.",
            "percentunit",
            [target(f"sum by (algorithm) ({rate(n.SPEC_ACCEPTED_TOKENS)}) / "
                    f"(sum by (algorithm) ({rate(n.SPEC_DRAFT_TOKENS)}) > 0)", "{{algorithm}}")],
        ),
        timeseries(
            "Tokens per verify",
            "Mean tokens one target_verify forward emitted per request (accepted drafts + the target's own): "
            "above 1 is what speculation gains over one-token decode steps.",
            "short",
            [target(f"sum by (algorithm) ({rate(n.SPEC_ACCEPTANCE_LENGTH + '_sum')}) / "
                    f"(sum by (algorithm) ({rate(n.SPEC_ACCEPTANCE_LENGTH + '_count')}) > 0)", "{{algorithm}}")],
        ),
        timeseries(
            "Draft tokens",
            "Draft tokens proposed and accepted per second, by algorithm (rejected = proposed - accepted; their "
            "slots are rolled back at the invalidation site spec_rollback).",
            "suffix: tok/s",
            [target(f"sum by (algorithm) ({rate(n.SPEC_DRAFT_TOKENS)})", "proposed {{algorithm}}"),
             target(f"sum by (algorithm) ({rate(n.SPEC_ACCEPTED_TOKENS)})", "accepted {{algorithm}}")],
        ),
    ]


def variables() -> list[dict[str, Any]]:
    ds = {"type": "prometheus", "uid": "${datasource}"}
    job_query = f"label_values({n.BUILD_INFO}, job)"
    instance_query = f'label_values({n.BUILD_INFO}{{job=~"$job"}}, instance)'
    return [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {"text": "Prometheus", "value": DATASOURCE_UID},
            "hide": 0,
            "refresh": 1,
            "regex": "",
            "options": [],
        },
        {
            "name": "job",
            "label": "Job",
            "type": "query",
            "datasource": ds,
            "definition": job_query,
            "query": {"query": job_query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "current": {"text": "swa-runtime", "value": "swa-runtime"},
            "includeAll": False,
            "multi": False,
            "refresh": 2,
            "sort": 1,
            "hide": 0,
            "regex": "",
            "options": [],
        },
        {
            "name": "instance",
            "label": "Instance",
            "type": "query",
            "datasource": ds,
            "definition": instance_query,
            "query": {"query": instance_query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "current": {"text": "All", "value": "$__all"},
            "includeAll": True,
            "allValue": ".+",
            "multi": True,
            "refresh": 2,
            "sort": 1,
            "hide": 0,
            "regex": "",
            "options": [],
        },
    ]


def build() -> dict[str, Any]:
    # what users see first (requests, latency, errors), the translation internals below
    items = requests() + translation_cache() + invalidation_and_events() + forwards() + speculative() + kv_memory() + prefix_cache()
    return {
        "uid": DASHBOARD_UID,
        "title": "swa-runtime: KV location translation",
        "description": "Translation cache, invalidations and classified key-change events, forwards, KV "
        "pools and request latency of swa-runtime. Generated by dashboards/generate.py; edit the code, "
        "not this JSON.",
        "tags": ["swa-runtime", "kv-cache", "generated"],
        "editable": False,
        "graphTooltip": 1,
        "timezone": "browser",
        "time": {"from": "now-30m", "to": "now"},
        "refresh": "10s",
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "links": [],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                },
                {
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "enable": True,
                    "expr": 'ALERTS{alertname=~"SWARuntime.+", alertstate="firing", job=~"$job"}',
                    "iconColor": "red",
                    "name": "Firing swa-runtime alerts",
                    "step": "30s",
                    "titleFormat": "{{alertname}}",
                    "textFormat": "{{site}} {{classification}} {{pool}} {{reason}}",
                    "useValueForTime": False,
                },
            ]
        },
        "templating": {"list": variables()},
        "panels": layout(items),
    }
