"""Helpers for tests that talk to live processes on loopback (a Prometheus, the server)."""

from __future__ import annotations

import json
import socket
import time
import urllib.parse
import urllib.request


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
