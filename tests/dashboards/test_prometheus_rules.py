"""Prometheus config and rules: promtool validation and unit tests, and the rules' contract.

The promtool unit tests (dashboards/prometheus/tests/*.yml) hold the firing and non-firing cases of
every alert; here we run them and check what promtool cannot: names against telemetry/names.py,
annotations, runbook anchors, coverage of every non-benign classification.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from dashboards import promql
from telemetry import names

REPO = Path(__file__).resolve().parents[2]
PROM = REPO / "dashboards" / "prometheus"
RULE_FILES = sorted((PROM / "rules").glob("*.yml"))
TEST_FILES = sorted((PROM / "tests").glob("*.yml"))
RUNBOOKS = REPO / "docs" / "runbooks.md"
# Prefixed by the `runbook_base` external label when Prometheus sets one (absolute links), else repo-relative.
RUNBOOK_BASE = "{{ $externalLabels.runbook_base }}"
EXPECTED_ALERTS = {
    "SWARuntimeStaleLoc",
    "SWARuntimeMissingInvalidation",
    "SWARuntimeKVOwnershipViolation",
    "SWARuntimeLocKeyCollision",
    "SWARuntimeLocCacheHitRatioLow",
    "SWARuntimeInvalidationStorm",
    "SWARuntimeKVPoolPressure",
    "SWARuntimeMetricsAbsent",
    "SWARuntimeRequestErrors",
    "SWARuntimeEngineDown",
    "SWARuntimeEngineRestarts",
    "SWARuntimeRequestsRefused",
    "SWARuntimeSlowFirstToken",
    "SWARuntimeSlowDecode",
}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=PROM)


def load_rules() -> list[dict]:
    return [rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def alerts() -> list[dict]:
    return [rule for rule in load_rules() if "alert" in rule]


def github_anchors(markdown: str) -> set[str]:
    """Anchors GitHub generates for headings: lower case, punctuation dropped, spaces to dashes."""
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", markdown, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


@pytest.mark.promtool
def test_promtool_check_config(promtool):
    result = run(promtool, "check", "config", "--lint=all", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: prometheus.yml is valid prometheus config file syntax" in result.stdout + result.stderr
    assert "SUCCESS: 2 rule files found" in result.stdout + result.stderr


@pytest.mark.promtool
def test_promtool_check_rules_with_lint(promtool):
    result = run(promtool, "check", "rules", "--lint=all", "--lint-fatal", *map(str, RULE_FILES))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert out.count("SUCCESS") == len(RULE_FILES), out
    total = sum(int(n) for n in re.findall(r"SUCCESS: (\d+) rules found", out))
    assert total == len(load_rules())


@pytest.mark.promtool
def test_promtool_unit_tests_pass(promtool):
    assert {p.name for p in TEST_FILES} >= {"alerts_test.yml", "recording_test.yml"}
    result = run(promtool, "test", "rules", *map(str, TEST_FILES))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert out.count("SUCCESS") == len(TEST_FILES), out
    assert "FAILED" not in out


@pytest.mark.promtool
def test_promtool_unit_tests_can_fail(promtool, tmp_path):
    """The alert tests detect a broken rule: drop the born-non-zero branch of SWARuntimeStaleLoc."""
    (tmp_path / "rules").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "rules" / "recording.yml").write_text((PROM / "rules" / "recording.yml").read_text())
    text = (PROM / "rules" / "alerts.yml").read_text()
    start = text.index("- alert: SWARuntimeStaleLoc")
    expr_end = text.index("labels:", start)
    broken = text[:start] + text[start:expr_end].split("\n          or\n")[0] + "\n        " + text[expr_end:]
    (tmp_path / "rules" / "alerts.yml").write_text(broken)
    (tmp_path / "tests" / "alerts_test.yml").write_text((PROM / "tests" / "alerts_test.yml").read_text())
    result = subprocess.run(
        [promtool, "test", "rules", "tests/alerts_test.yml"], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert result.returncode != 0
    assert "alertname: SWARuntimeStaleLoc, time: 4m" in result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_quiet_case():
    spec = yaml.safe_load((PROM / "tests" / "alerts_test.yml").read_text())
    firing, quiet = set(), set()
    for case in spec["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert firing >= EXPECTED_ALERTS
    assert quiet >= EXPECTED_ALERTS


def test_alert_set_labels_and_annotations():
    rules = alerts()
    assert {r["alert"] for r in rules} == EXPECTED_ALERTS
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        for key in ("summary", "description", "runbook_url"):
            assert rule["annotations"].get(key, "").strip(), f"{rule['alert']} lacks {key}"
        assert rule["annotations"]["runbook_url"] == f"{RUNBOOK_BASE}docs/runbooks.md#{rule['alert'].lower()}"


def test_runbook_anchor_exists_for_every_alert():
    markdown = RUNBOOKS.read_text()
    anchors = github_anchors(markdown)
    for rule in alerts():
        path, anchor = rule["annotations"]["runbook_url"].removeprefix(RUNBOOK_BASE).split("#")
        assert (REPO / path).resolve() == RUNBOOKS.resolve()
        assert anchor in anchors, f"docs/runbooks.md has no heading for #{anchor}"


def test_runbook_anchor_check_can_fail():
    assert "swaruntimestaleloc" in github_anchors("## SWARuntimeStaleLoc\n")
    assert "swaruntimestaleloc" not in github_anchors("## SWARuntimeStale\n")


def test_rules_name_only_contract_metrics_and_label_values():
    known = promql.contract_series() | promql.recording_rule_names()
    for rule in load_rules():
        where = rule.get("alert") or rule.get("record")
        assert promql.referenced_names(rule["expr"]), f"{where} names no swa_runtime metric"
        assert promql.check_expr(rule["expr"], known) == [], where


def test_every_non_benign_classification_alerts():
    """names.NON_BENIGN_CLASSIFICATIONS promises an alert for each bug class; benign ones never alert."""
    covered = set()
    for rule in alerts():
        for op, value in re.findall(r'classification\s*(=~|=)\s*"([^"]+)"', rule["expr"]):
            covered |= set(value.split("|"))
    assert covered == set(names.NON_BENIGN_CLASSIFICATIONS)


def test_recording_rules_follow_level_metric_operation():
    """`swa_runtime:` rules are per scrape target (they keep `instance`); `swa_runtime_model:` rules aggregate a
    fleet's replicas by model (they keep `model`, joined from the build info, and drop `instance`)."""
    levels = set()
    for rule in load_rules():
        if "record" in rule:
            level, metric, operation = rule["record"].split(":")
            assert level in ("swa_runtime", "swa_runtime_model") and metric and operation, rule["record"]
            assert not metric.startswith("swa_runtime") and not metric.endswith("_total"), rule["record"]
            groupings = re.findall(r"\bby \(([^)]*)\)", rule["expr"])
            if level == "swa_runtime_model":
                assert all(g.startswith("job, model") for g in groupings), rule["record"]
                assert "group_left (model) swa_runtime_build_info" in rule["expr"] or "build_info" in rule["expr"]
            else:
                assert all("instance" in g or g.startswith("le") for g in groupings if "job" in g), rule["record"]
            levels.add(level)
    assert levels == {"swa_runtime", "swa_runtime_model"}


def test_every_alert_names_the_instance():
    """In a fleet an alert must say which replica: every summary and description carries the instance."""
    for rule in alerts():
        for key in ("summary", "description"):
            assert "$labels.instance" in rule["annotations"][key], (rule["alert"], key)
