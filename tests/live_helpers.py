"""Helpers for tests that talk to live processes on loopback (a Prometheus, the server)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str) -> None:
    """Poll `predicate` until it is truthy; connection errors count as not yet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def prom_query(url: str, expr: str) -> list[dict]:
    """Instant-query result list from the Prometheus at `url`."""
    query = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{url}/api/v1/query?{query}", timeout=5) as response:
        return json.load(response)["data"]["result"]


RULES_DIR = Path(__file__).resolve().parents[1] / "dashboards" / "prometheus" / "rules"


def start_prometheus(work: Path, target: str | None, scrape_configs: str | None = None) -> tuple[subprocess.Popen, str]:
    """A real Prometheus on loopback scraping `target` (host:port) every second as job `swa-runtime` (or
    with the given `scrape_configs` YAML list instead), with our recording and alert rules, its data and log
    under `work`. Skips the test without the binary."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not on PATH (Debian package `prometheus`)")
    work.mkdir(parents=True, exist_ok=True)
    config = work / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{RULES_DIR / 'recording.yml'}', '{RULES_DIR / 'alerts.yml'}']\n"
        "scrape_configs:\n"
        + (scrape_configs or f"  - job_name: swa-runtime\n    static_configs: [{{targets: ['{target}']}}]\n")
    )
    return launch_prometheus(binary, config, work)


def launch_prometheus(binary: str, config: Path, work: Path) -> tuple[subprocess.Popen, str]:
    """Prometheus `binary` on a free loopback port with `config`, its data and log under `work`, once ready."""
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=(work / "prometheus.log").open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: urllib.request.urlopen(f"{url}/-/ready", timeout=1).status == 200, 30, "Prometheus ready")
    except BaseException:
        stop(proc)
        raise
    return proc, url


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Terminate a child process, killing it if it does not exit in time."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
