"""The fleet dashboard, as code: replicas behind the SGLang router watched from one Prometheus (docs/fleet.md).

Three rows: fleet-wide aggregates over the selected instances (the same numbers as the main dashboard, summed
over replicas), the same quantities broken down by `instance`, and the router's own metrics (job
`$router_job`). It shares the main dashboard's variables, helpers and frame; `python -m dashboards.generate`
renders both.

The router's metric names are those of `sglang-router` 0.3.2 (pinned in pyproject.toml): `ROUTER_METRICS`
lists them, and the fleet test proves each returns data from a live router.
"""

from __future__ import annotations

from typing import Any

from dashboards import dashboard
from dashboards.dashboard import NON_BENIGN, RATE, TOTAL, USED, quantiles, rate, sel
from dashboards.panels import layout, row, stat, table, target, timeseries
from telemetry import names as n

FLEET_UID = "swa-runtime-fleet"
ROUTER_SEL = 'job=~"$router_job"'
FINISHED = 'status="finished"'
GENERATION_PATHS = 'path=~"/generate|/v1/.+"'
ROUTER_METRICS = (
    "smg_router_requests_total",  # requests routed, by endpoint, model, streaming
    "smg_http_responses_total",  # responses to clients, by status code
    "smg_router_upstream_responses_total",  # replicas' answers, by status (and the router's errors reaching them)
    "smg_worker_health",  # 1 while the router counts a replica healthy, by worker URL
    "smg_worker_requests_active",  # requests in flight on each replica
    "smg_http_request_duration_seconds_bucket",  # latency the router's clients see, by path
)


def rsel(metric: str, extra: str = "") -> str:
    return f"{metric}{{{ROUTER_SEL}{', ' + extra if extra else ''}}}"


def rrate(metric: str, extra: str = "") -> str:
    return f"rate({rsel(metric, extra)}[{RATE}])"


def _hit_ratio(by: str) -> str:
    hits, misses = rate(n.LOC_CACHE_HITS), rate(n.LOC_CACHE_MISSES)
    return f"sum{by} ({hits})\n/\n(sum{by} ({hits}) + sum{by} ({misses}) > 0)"


def _kv_used(by: str) -> str:
    return f"sum by ({by}) ({n.KV_TOKENS}{sel(USED)})\n/\n(sum by ({by}) ({n.KV_TOKENS}{sel(TOTAL)}) > 0)"


def overview() -> list[dict[str, Any]]:
    return [
        row("Fleet"),
        stat("Replicas up", "Replicas of the selected job and instances that Prometheus scrapes successfully, of "
             "all it knows (a replica being restarted by `swa-runtime fleet` shows as down meanwhile).", "none",
             [target(f'sum(up{{{dashboard.SEL}}})', "up"), target(f"count({n.BUILD_INFO}{sel()})", "exposing metrics")],
             width=6),
        stat("Fleet hit ratio", "Translation-cache hits / lookups summed over every selected replica.",
             "percentunit", [target(_hit_ratio(""), "hit ratio")], width=6, min_=0, max_=1,
             thresholds=dashboard._steps(("red", None), ("green", dashboard.HIT_RATIO_ALERT))),
        stat("Bug-class key-change events over the range", "view_offset, cross_forward, stale_loc and "
             "capture_pollution events on all selected replicas in the time range: anything above 0 has alerted; "
             "the per-instance panel below says where.", "short",
             [target(f"sum(increase({n.LOC_KEY_CHANGE_EVENTS}{sel(NON_BENIGN)}[$__range]))", "events")], width=6,
             thresholds=dashboard._steps(("green", None), ("red", 1))),
        stat("Fleet hit ratio by model (5m)", "The recording rule swa_runtime_model:loc_cache_hit_ratio:rate5m: "
             "every replica of a model together, per policy.", "percentunit",
             [target('swa_runtime_model:loc_cache_hit_ratio:rate5m{job=~"$job"}', "{{model}} {{policy}}")],
             width=6, min_=0, max_=1),
        timeseries("Fleet KV usage", "Used / total slots per pool, summed over the selected replicas.",
                   "percentunit", [target(_kv_used("pool"), "{{pool}}")], min_=0, max_=1,
                   thresholds=dashboard._steps(("green", None), ("red", dashboard.KV_PRESSURE_ALERT))),
        timeseries("Fleet TTFT and ITL (p95)", "95th percentile of time to first token and inter-token latency "
                   "over every request of the selected replicas.", "s",
                   [target(f"histogram_quantile(0.95, sum by (le) ({rate(n.TIME_TO_FIRST_TOKEN + '_bucket')}))", "TTFT p95"),
                    target(f"histogram_quantile(0.95, sum by (le) ({rate(n.INTER_TOKEN_LATENCY + '_bucket')}))", "ITL p95")]),
        timeseries("Fleet requests by status", "Requests ending per second on all selected replicas, by status.",
                   "reqps", [target(f"sum by (status) ({rate(n.REQUESTS_TOTAL)})", "{{status}}")], stack=True),
    ]


def per_instance() -> list[dict[str, Any]]:
    return [
        row("Per instance"),
        timeseries("Hit ratio by instance", "Translation-cache hit ratio of each replica: one replica far below "
                   "the others is missing an invalidation or churning its cache.", "percentunit",
                   [target(_hit_ratio(" by (instance)"), "{{instance}}")], min_=0, max_=1),
        timeseries("Bug-class key-change events by instance", "Non-benign key-change events per second on each "
                   "replica, by classification: the alert names the same instance.", "ops",
                   [target(f"sum by (instance, classification) ({rate(n.LOC_KEY_CHANGE_EVENTS, NON_BENIGN)})",
                           "{{instance}} {{classification}}")]),
        timeseries("KV usage by instance", "Used / total slots per pool on each replica.", "percentunit",
                   [target(_kv_used("instance, pool"), "{{instance}} {{pool}}")], min_=0, max_=1),
        timeseries("TTFT p95 by instance", "95th percentile time to first token on each replica.", "s",
                   quantiles(n.TIME_TO_FIRST_TOKEN, "instance", (0.95,))),
        timeseries("ITL p95 by instance", "95th percentile inter-token latency on each replica.", "s",
                   quantiles(n.INTER_TOKEN_LATENCY, "instance", (0.95,))),
        timeseries("Requests finished by instance", "Requests finished per second on each replica: how the router "
                   "spreads the load.", "reqps",
                   [target(f"sum by (instance) ({rate(n.REQUESTS_TOTAL, FINISHED)})", "{{instance}}")]),
        table("Replicas", "swa_runtime_build_info of each replica: version, model, translation policy and attention "
              "backend (replicas of one fleet should agree).", "none",
              [target(f"{n.BUILD_INFO}{sel()}", "", instant=True, table=True)],
              hide=("Time", "Value", "__name__", "job"), width=24),
    ]


def router() -> list[dict[str, Any]]:
    return [
        row("Router"),
        timeseries("Routed requests by endpoint", "Requests the router forwarded per second, by endpoint.", "reqps",
                   [target(f"sum by (endpoint) ({rrate('smg_router_requests_total')})", "{{endpoint}}")]),
        timeseries("Router responses by status", "Responses the router's clients got per second, by HTTP status.",
                   "reqps", [target(f"sum by (status_code) ({rrate('smg_http_responses_total')})", "{{status_code}}")]),
        timeseries("Replica answers by status", "Replicas' answers to the router per second by status; an "
                   "error_code (call_upstream_request_error) is a replica the router could not reach, retried on "
                   "another.", "reqps",
                   [target(f"sum by (status_code, error_code) ({rrate('smg_router_upstream_responses_total')})",
                           "{{status_code}} {{error_code}}")]),
        timeseries("Replicas healthy in the router", "1 while the router routes to a replica (by its URL), 0 "
                   "after failed health checks or while `swa-runtime fleet` restarts it.", "none",
                   [target(f"max by (worker) ({rsel('smg_worker_health')})", "{{worker}}")], min_=0, max_=1),
        timeseries("In flight per replica (router)", "Requests the router has in flight on each replica.", "short",
                   [target(f"sum by (worker) ({rsel('smg_worker_requests_active')})", "{{worker}}")]),
        timeseries("Router latency (p95)", "95th percentile of the request duration the router's clients see, "
                   "by path (generation endpoints only).", "s",
                   [target("histogram_quantile(0.95, sum by (le, path) "
                           f"({rrate('smg_http_request_duration_seconds_bucket', GENERATION_PATHS)}))", "{{path}}")]),
    ]


def router_variable() -> dict[str, Any]:
    query = "label_values(smg_worker_health, job)"
    return {
        "name": "router_job", "label": "Router job", "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"}, "definition": query,
        "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "current": {"text": "swa-router", "value": "swa-router"}, "includeAll": False, "multi": False,
        "refresh": 2, "sort": 1, "hide": 0, "regex": "", "options": [],
    }


def build() -> dict[str, Any]:
    """The main dashboard's frame (variables, annotations, settings) with the fleet's rows."""
    board = dashboard.build()
    board.update(
        uid=FLEET_UID,
        title="swa-runtime: fleet",
        description="Replicas behind the SGLang router: fleet-wide aggregates, a per-instance breakdown and the "
        "router's own metrics. Generated by dashboards/fleet.py; edit the code, not this JSON.",
        tags=["swa-runtime", "fleet", "generated"],
        links=[{"title": "KV location translation", "type": "link", "url": f"/d/{dashboard.DASHBOARD_UID}",
                "icon": "dashboard", "targetBlank": False}],
        panels=layout(overview() + per_instance() + router()),
    )
    board["templating"] = {"list": board["templating"]["list"] + [router_variable()]}
    return board
