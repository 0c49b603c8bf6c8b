"""The generated Grafana dashboard: committed JSON is current, queries name only contract metrics,
every panel is documented, variables and datasource wiring are consistent."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dashboards import dashboard, generate, promql
from dashboards.snapshot import substitute

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "dashboards" / "grafana" / "dashboards" / "swa-runtime.json"
PROVISIONING = REPO / "dashboards" / "grafana" / "provisioning"


def run_check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dashboards.generate", "--check", "--output", str(path)],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )


@pytest.fixture(scope="module")
def committed() -> dict:
    return json.loads(COMMITTED.read_text())


def panels(dash: dict) -> list[dict]:
    return [p for p in generate.iter_panels(dash) if p["type"] != "row"]


def test_check_passes_on_committed_json():
    result = run_check(COMMITTED)
    assert result.returncode == 0, result.stderr
    assert "up to date" in result.stdout


def test_check_also_works_as_a_script():
    result = subprocess.run(
        [sys.executable, "dashboards/generate.py", "--check"], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_check_fails_on_unknown_metric_in_committed_copy(tmp_path):
    text = COMMITTED.read_text()
    assert "swa_runtime_loc_cache_misses_total" in text
    copy = tmp_path / "swa-runtime.json"
    copy.write_text(text.replace("swa_runtime_loc_cache_misses_total", "swa_runtime_loc_cache_mises_total", 1))
    result = run_check(copy)
    assert result.returncode == 1
    assert "unknown metric or rule 'swa_runtime_loc_cache_mises_total'" in result.stderr


def test_check_fails_on_unknown_recording_rule_and_label_value(tmp_path):
    text = COMMITTED.read_text()
    text = text.replace("swa_runtime:loc_cache_hit_ratio:rate5m", "swa_runtime:loc_cache_hit_ratio:rate1m")
    text = text.replace('classification!=\\"benign_fresh_tensor\\"', 'classification!=\\"benign\\"')
    copy = tmp_path / "swa-runtime.json"
    copy.write_text(text)
    result = run_check(copy)
    assert result.returncode == 1
    assert "'swa_runtime:loc_cache_hit_ratio:rate1m'" in result.stderr
    assert "'benign' is not in classification values" in result.stderr


def test_check_fails_when_generator_names_unknown_metric(monkeypatch, tmp_path):
    """A query added in code with a typo is caught even when the JSON was regenerated from it."""
    original = dashboard.requests

    def with_typo():
        items = original()
        items[-1]["targets"][0]["expr"] = "sum(swa_runtime_num_runing_reqs)"
        return items

    monkeypatch.setattr(dashboard, "requests", with_typo)
    out = tmp_path / "swa-runtime.json"
    out.write_text(generate.render())
    problems = generate.check(out)
    assert any("swa_runtime_num_runing_reqs" in p for p in problems)
    assert generate.main(["--output", str(out)]) == 1  # refuses to write it either


def test_check_fails_on_stale_json(tmp_path):
    stale = json.loads(COMMITTED.read_text())
    stale["title"] = "hand edited"
    copy = tmp_path / "swa-runtime.json"
    copy.write_text(json.dumps(stale, indent=2) + "\n")
    result = run_check(copy)
    assert result.returncode == 1
    assert "differs from what generate.py produces" in result.stderr
    assert "hand edited" in result.stderr


def test_metric_regex_reads_names_out_of_promql():
    expr = 'sum(rate(swa_runtime_loc_cache_hits_total{job=~"$job"}[5m])) / swa_runtime:loc_cache_hit_ratio:rate5m + foo_swa_runtime_x'
    assert promql.referenced_names(expr) == ["swa_runtime_loc_cache_hits_total", "swa_runtime:loc_cache_hit_ratio:rate5m"]
    known = promql.contract_series()
    assert "swa_runtime_forward_seconds_bucket" in known
    assert "swa_runtime_forward_seconds" not in known  # a histogram has no bare series
    assert "swa_runtime_kv_tokens_bucket" not in known  # a gauge has no buckets


def test_dashboard_identity(committed):
    assert committed["uid"] == dashboard.DASHBOARD_UID
    assert committed["schemaVersion"] == dashboard.SCHEMA_VERSION >= 39
    assert [v["name"] for v in committed["templating"]["list"]] == ["datasource", "job", "instance"]
    ds_var = committed["templating"]["list"][0]
    assert ds_var["type"] == "datasource" and ds_var["query"] == "prometheus"


def test_every_panel_has_unit_description_and_grouping_row(committed):
    current_row = None
    titles = set()
    for panel in committed["panels"]:
        if panel["type"] == "row":
            current_row = panel["title"]
            continue
        assert current_row, f"{panel['title']} is not under a row"
        assert panel["description"].strip(), panel["title"]
        assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        assert panel["title"] not in titles
        titles.add(panel["title"])
    ids = [p["id"] for p in committed["panels"]]
    assert len(ids) == len(set(ids))


def test_required_panels_present(committed):
    titles = {p["title"] for p in panels(committed)}
    required = {
        "Hit ratio", "Lookups by result", "Misses by reason", "Invalidations by site",
        "Key-change events by classification", "Top key-change sites over the range", "Forwards by mode",
        "Forward latency", "KV usage: full vs SWA", "SWA evictions and host-cache traffic",
        "Time to first token", "Inter-token latency", "End-to-end request latency", "Token throughput",
        "Running and queued requests",
    }
    assert required <= titles


def test_queries_filter_on_variables_and_use_rate_interval(committed):
    for p in panels(committed):
        for t in p["targets"]:
            expr = t["expr"]
            for selector in re.findall(r"(swa_runtime[_:][A-Za-z0-9_:]*)(\{[^}]*\})?", expr):
                assert 'job=~"$job"' in selector[1] and 'instance=~"$instance"' in selector[1], (p["title"], expr)
            for window in re.findall(r"\[([^\]]+)\]", expr):
                assert window in ("$__rate_interval", "$__range"), (p["title"], expr)


def test_datasource_provisioning_matches_dashboard_default(committed):
    ds = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert len(ds) == 1 and ds[0]["type"] == "prometheus"
    assert ds[0]["uid"] == dashboard.DATASOURCE_UID == committed["templating"]["list"][0]["current"]["value"]
    assert ds[0]["isDefault"] is True
    provider = yaml.safe_load((PROVISIONING / "dashboards" / "provider.yml").read_text())["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"]


@pytest.mark.promtool
@pytest.mark.parametrize("name", sorted(generate.OUTPUTS))
def test_every_query_parses_in_promtool(promtool, name, tmp_path):
    """Dashboard PromQL (of each generated dashboard), with Grafana variables substituted, is valid: load it
    as recording rules.

    Variable queries use Grafana's label_values(selector, label); their selector is checked.
    """
    variables = {"__rate_interval": "1m", "__range": "15m", "job": ".+", "instance": ".+", "router_job": ".+"}
    exprs = []
    for _, expr in generate.iter_queries(json.loads(generate.OUTPUTS[name].read_text())):
        match = re.fullmatch(r"label_values\((.*),\s*\w+\)", expr)
        exprs.append(substitute(match.group(1) if match else expr, variables))
    rules = [{"record": f"dashboard:query_{i}:check", "expr": expr} for i, expr in enumerate(exprs)]
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout
