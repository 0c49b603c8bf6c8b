"""The observability stack against a live runtime: the real server (tiny model) scraped by a real Prometheus
on loopback with our rule files. Every dashboard query must return data; a fault switch that drops an
invalidation must make the missing-invalidation or stale-location alert expression true, and a clean run
must keep it false."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from dashboards.generate import OUTPUT as DASHBOARD_JSON
from live_helpers import free_port, start_prometheus, stop, wait_for
from live_helpers import prom_query as query
from dashboards.snapshot import Prometheus, fetch

pytestmark = [pytest.mark.promtool, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "dashboards" / "prometheus" / "rules"
ALERT_EXPRS = {
    # the alert expressions, read from the rule file so the test follows the rules as written
    rule["alert"]: rule["expr"]
    for group in yaml.safe_load((RULES / "alerts.yml").read_text())["groups"]
    for rule in group["rules"] if "alert" in rule
}
BUG_ALERTS = ("SWARuntimeMissingInvalidation", "SWARuntimeStaleLoc")


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def start_runtime(tmp: Path, *inject: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "runtime", "serve", "--model", "tiny", "--port", str(port),
           "--max-total-tokens", "512", "--swa-full-tokens-ratio", "0.5", "--chunked-prefill-size", "32",
           "--speculative-algorithm", "ngram"]  # so that the dashboard's speculative panels have data too
    for name in inject:
        cmd += ["--inject", name]
    log = (tmp / f"runtime-{port}.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: proc.poll() is None and get(f"{url}/health") is not None, 120, "runtime /health")
    return proc, url


def drive(url: str, seconds: float, max_requests: int = 200) -> int:
    """Mixed-length greedy requests from 3 client threads for `seconds` (bounded); returns requests sent."""
    sent = [0]
    deadline = time.monotonic() + seconds

    def client(seed: int) -> None:
        i = seed
        while time.monotonic() < deadline and sent[0] < max_requests:
            body = json.dumps({"input_ids": [2] + [4 + (i * 7 + j) % 250 for j in range(5 + (i * 11) % 40)],
                               "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}}).encode()
            req = urllib.request.Request(f"{url}/generate", body, {"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=60).read()
            sent[0] += 1
            i += 3

    threads = [threading.Thread(target=client, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sent[0]


@contextmanager
def live_stack(tmp: Path, *inject: str, seconds: float = 20.0):
    """Runtime + Prometheus; drives traffic, then yields (requests sent, Prometheus URL, bug-alert results)."""
    runtime, url = start_runtime(tmp, *inject)
    try:
        prom, prom_url = start_prometheus(tmp / f"prom-{free_port()}", url.removeprefix("http://"))
    except BaseException:
        stop(runtime)
        raise
    try:
        wait_for(lambda: query(prom_url, 'up{job="swa-runtime"} == 1'), 30, "first scrape")
        sent = drive(url, seconds)
        time.sleep(3)  # two more scrapes after the last request
        yield sent, prom_url, {name: query(prom_url, ALERT_EXPRS[name]) for name in BUG_ALERTS}
    finally:
        stop(runtime)
        stop(prom)


def test_every_dashboard_query_returns_data_and_a_clean_run_raises_no_bug_alert(tmp_path):
    with live_stack(tmp_path) as (sent, prom_url, alerts):
        assert sent >= 10
        assert alerts == {name: [] for name in BUG_ALERTS}
        dashboard = json.loads(Path(DASHBOARD_JSON).read_text())
        panels = fetch(Prometheus(prom_url), dashboard, end=time.time(), range_s=60, rate_interval="10s")
        assert len(panels) >= 15
        problems = {p.title: (p.errors, p.empty_targets) for p in panels if p.errors or p.empty_targets}
        assert problems == {}
        finished = query(prom_url, 'swa_runtime_requests_total{status="finished"}')
        assert float(finished[0]["value"][1]) == sent


def test_a_dropped_forward_invalidation_makes_a_bug_alert_expression_true(tmp_path):
    # Every decode step allocates, and each allocation invalidates on its own: the forward-entry invalidation
    # is only missed when the allocator's invalidation is dropped too.
    faults = ("skip-forward-invalidation", "skip-alloc-invalidation")
    with live_stack(tmp_path, *faults, seconds=10.0) as (sent, prom_url, alerts):
        assert sent >= 5
        firing = {name for name, result in alerts.items() if result}
        assert firing, alerts
        for name in firing:
            assert all(r["metric"].get("site") == "kv_write" for r in alerts[name])
