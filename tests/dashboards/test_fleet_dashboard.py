"""The generated fleet dashboard: committed JSON current, the main dashboard's variables plus the router's job,
per-instance panels grouped by instance, replica queries filtered on $job/$instance, router queries on
$router_job naming only the router metrics it is known to export (test_dashboard_generator.py parses every
query of both dashboards with promtool)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dashboards import dashboard, fleet, generate

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def board() -> dict:
    return json.loads(generate.FLEET_OUTPUT.read_text())


def rows(board: dict) -> dict[str, list[dict]]:
    out, current = {}, None
    for panel in board["panels"]:
        if panel["type"] == "row":
            current = out.setdefault(panel["title"], [])
        else:
            current.append(panel)
    return out


def test_committed_json_is_current_and_checked():
    result = subprocess.run([sys.executable, "-m", "dashboards.generate", "--check", "--dashboard", "swa-runtime-fleet"],
                            capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert generate.check(generate.FLEET_OUTPUT, "swa-runtime-fleet") == []
    assert generate.check(generate.FLEET_OUTPUT, "swa-runtime") != []  # each file is checked against its own build


def test_identity_variables_and_rows(board):
    assert board["uid"] == fleet.FLEET_UID != dashboard.DASHBOARD_UID
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource", "job", "instance", "router_job"]
    assert list(rows(board)) == ["Fleet", "Per instance", "Router"]
    assert all(p["description"].strip() and p["fieldConfig"]["defaults"].get("unit") for r in rows(board).values()
               for p in r)


def test_per_instance_panels_break_down_by_instance(board):
    for panel in rows(board)["Per instance"]:
        if panel["type"] == "table":
            continue
        for t in panel["targets"]:
            assert re.search(r"by \((instance|le, instance)\b", t["expr"]), (panel["title"], t["expr"])
            assert "{{instance}}" in t["legendFormat"], panel["title"]


def test_replica_queries_filter_on_job_and_instance_and_router_queries_on_router_job(board):
    for panel in generate.iter_panels(board):
        for t in panel.get("targets", []):
            expr = t["expr"]
            for name, selector in re.findall(r"\b(swa_runtime_[a-z_]+|up)(\{[^}]*\})", expr):
                assert 'job=~"$job"' in selector and 'instance=~"$instance"' in selector, (panel["title"], expr)
            for name, selector in re.findall(r"\b(smg_[a-z_]+)(\{[^}]*\})?", expr):
                assert name in fleet.ROUTER_METRICS, name
                assert 'job=~"$router_job"' in selector, (panel["title"], expr)
            for window in re.findall(r"\[([^\]]+)\]", expr):
                assert window in ("$__rate_interval", "$__range"), (panel["title"], expr)


def test_router_metric_list_is_used(board):
    text = json.dumps(board)
    assert all(name in text for name in fleet.ROUTER_METRICS)
