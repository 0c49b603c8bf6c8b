"""docs/metrics.md lists every recording rule and every alert that the rule files define, and nothing else
(the docs once listed 15 recording rules and 7 alerts while the files had 22 and 9)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "dashboards" / "prometheus" / "rules"
METRICS_DOC = REPO / "docs" / "metrics.md"


def rule_names(file: str, key: str) -> set[str]:
    groups = yaml.safe_load((RULES / file).read_text())["groups"]
    return {rule[key] for group in groups for rule in group["rules"] if key in rule}


def rules_section() -> str:
    text = METRICS_DOC.read_text()
    start = text.index("## Recording rules, alerts and the dashboard")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_every_recording_rule_is_documented():
    documented = set(re.findall(r"`(swa_runtime(?:_model)?:[a-z0-9_:]+)`", rules_section()))
    assert documented == rule_names("recording.yml", "record")


def test_every_alert_is_documented():
    documented = set(re.findall(r"`(SWARuntime[A-Za-z]+)`", rules_section()))
    assert documented == rule_names("alerts.yml", "alert")
