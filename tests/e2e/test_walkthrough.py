"""The README's path from a bug to its code path, without Docker: a server with a historical invalidation bug
put back, the distribution's Prometheus run with the provided local config (only the target, the rule files'
absolute paths and faster intervals changed), the alert firing for that server, its runbook link resolving to
a section of docs/runbooks.md, and `diagnose --from-log` on the server's own log naming the same class."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import yaml

from live_helpers import free_port, launch_prometheus, stop, wait_for

pytestmark = [pytest.mark.promtool, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
LOCAL_CONFIG = REPO / "dashboards" / "prometheus" / "prometheus-local.yml"
RUNBOOKS = REPO / "docs" / "runbooks.md"
FAULTS = ("skip-forward-invalidation", "skip-alloc-invalidation")  # as in tests/e2e/test_live_stack.py


def github_anchor(heading: str) -> str:
    """The fragment a Markdown renderer (GitHub's rules) gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def local_prometheus(work: Path, target: str) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not on PATH (Debian package `prometheus`)")
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(LOCAL_CONFIG.parent / f) for f in config["rule_files"]]
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "swa-runtime"  # what the rules and dashboards select
    job["static_configs"] = [{"targets": [target]}]
    work.mkdir(parents=True, exist_ok=True)
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    return launch_prometheus(binary, work / "prometheus.yml", work)


def firing(prom_url: str) -> list[dict]:
    with urllib.request.urlopen(f"{prom_url}/api/v1/alerts", timeout=5) as r:
        return [a for a in json.load(r)["data"]["alerts"] if a["state"] == "firing"]


def send_requests(url: str, stop_event: threading.Event) -> None:
    i = 0
    while not stop_event.is_set() and i < 100:
        body = json.dumps({"input_ids": [2] + [4 + (i * 7 + j) % 250 for j in range(8 + i % 20)],
                           "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}).encode()
        req = urllib.request.Request(f"{url}/generate", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=60).read()
        i += 1


def test_an_injected_bug_fires_its_alert_whose_runbook_and_diagnose_name_it(tmp_path):
    port = free_port()
    log_path = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "runtime", "serve", "--model", "tiny", "--port", str(port), "--log-format", "json",
           "--max-total-tokens", "512", "--swa-full-tokens-ratio", "0.5", "--chunked-prefill-size", "32"]
    for fault in FAULTS:
        cmd += ["--inject", fault]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log_path.open("w"), cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    prom = None
    done = threading.Event()
    try:
        wait_for(lambda: server.poll() is None and urllib.request.urlopen(f"{url}/health", timeout=2).status == 200,
                 120, "server /health")
        prom, prom_url = local_prometheus(tmp_path / "prom", f"127.0.0.1:{port}")
        traffic = threading.Thread(target=send_requests, args=(url, done))
        traffic.start()
        alerts: list[dict] = []
        wait_for(lambda: alerts.extend(a for a in firing(prom_url) if a["labels"]["alertname"].startswith("SWARuntime"))
                 or alerts, 60, "a bug alert firing")
        done.set()
        traffic.join(60)
    finally:
        done.set()
        server.terminate()  # SIGTERM: the server drains and flushes the suppressed-event records to its log
        server.wait(60)
        if prom is not None:
            stop(prom)

    alert = alerts[0]
    assert alert["labels"]["alertname"] in ("SWARuntimeMissingInvalidation", "SWARuntimeStaleLoc")
    assert alert["labels"]["instance"] == f"127.0.0.1:{port}" and alert["labels"]["site"] == "kv_write"

    # the runbook link names a file and a section that exist
    link = alert["annotations"]["runbook_url"]
    path, _, fragment = link.partition("#")
    assert path.endswith("docs/runbooks.md") and fragment
    anchors = {github_anchor(line.lstrip("#")) for line in RUNBOOKS.read_text().splitlines() if line.startswith("#")}
    assert fragment in anchors, (fragment, sorted(anchors))
    assert fragment == github_anchor(alert["labels"]["alertname"])

    # diagnose --from-log on the server's own log: exit 1 with a bug row for the class the alert counted
    out = subprocess.run([sys.executable, "-m", "runtime", "diagnose", "--from-log", str(log_path), "--json"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    classes = {row["classification"] for row in report["rows"] if row["site"] == "kv_write"}
    wanted = {"SWARuntimeStaleLoc": {"stale_loc"},
              "SWARuntimeMissingInvalidation": {"cross_forward", "capture_pollution"}}[alert["labels"]["alertname"]]
    assert classes & wanted, report["rows"]
