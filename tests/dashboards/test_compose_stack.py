"""docker-compose.yml, Dockerfile and their mounts. No Docker engine runs here, so the files are parsed
and cross-checked: every mounted path exists, and the services agree on names, ports and paths."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from dashboards import dashboard

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def bind_mounts(service: dict) -> list[tuple[str, str]]:
    mounts = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            mounts.append((source, target))
    return mounts


def test_services_present(compose):
    assert {"runtime", "prometheus", "grafana"} <= set(compose["services"])


def test_every_bind_mount_exists(compose):
    mounts = [m for svc in compose["services"].values() for m in bind_mounts(svc)]
    assert len(mounts) >= 5
    for source, _ in mounts:
        assert (REPO / source).exists(), f"compose mounts missing path {source}"


def test_runtime_service_serves_on_the_scraped_port(compose):
    runtime = compose["services"]["runtime"]
    assert runtime["build"]["context"] == "."
    assert (REPO / runtime["build"]["dockerfile"]).is_file()
    assert runtime["command"] == ["serve", "--host", "0.0.0.0", "--port", "30000"]
    scrape = yaml.safe_load((REPO / "dashboards" / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in scrape["scrape_configs"] if j["job_name"] == "swa-runtime")
    assert job["static_configs"][0]["targets"] == ["runtime:30000"]


def test_prometheus_mounts_config_and_rules_where_the_config_expects_them(compose):
    prom = compose["services"]["prometheus"]
    mounts = dict((target, source) for source, target in bind_mounts(prom))
    assert mounts["/etc/prometheus/prometheus.yml"] == "./dashboards/prometheus/prometheus.yml"
    assert mounts["/etc/prometheus/rules"] == "./dashboards/prometheus/rules"
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    config = yaml.safe_load((REPO / "dashboards" / "prometheus" / "prometheus.yml").read_text())
    for rule_file in config["rule_files"]:
        assert (REPO / "dashboards" / "prometheus" / rule_file).is_file()
        assert rule_file.startswith("rules/")


def test_alertmanager_wiring(compose):
    config = yaml.safe_load((REPO / "dashboards" / "prometheus" / "prometheus.yml").read_text())
    targets = config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert targets == ["alertmanager:9093"] and "alertmanager" in compose["services"]
    am = yaml.safe_load((REPO / "dashboards" / "alertmanager" / "alertmanager.yml").read_text())
    assert am["route"]["receiver"] in {r["name"] for r in am["receivers"]}


def test_grafana_provisioning_and_anonymous_viewer(compose):
    grafana = compose["services"]["grafana"]
    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    mounts = dict((target, source) for source, target in bind_mounts(grafana))
    assert mounts["/etc/grafana/provisioning"] == "./dashboards/grafana/provisioning"
    provider = yaml.safe_load(
        (REPO / "dashboards" / "grafana" / "provisioning" / "dashboards" / "provider.yml").read_text()
    )["providers"][0]
    dash_dir = provider["options"]["path"]
    assert mounts[dash_dir] == "./dashboards/grafana/dashboards"
    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(dash_dir + "/") and (REPO / mounts[dash_dir] / Path(home).name).is_file()
    ds = yaml.safe_load(
        (REPO / "dashboards" / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"][0]
    assert ds["url"] == "http://prometheus:9090" and ds["uid"] == dashboard.DATASOURCE_UID


def test_images_are_pinned(compose):
    for name, service in compose["services"].items():
        if "image" in service and "build" not in service:
            assert re.search(r":v?\d+\.\d+\.\d+$", service["image"]), f"{name} image not pinned"


def test_dockerfile_base_entrypoint_and_no_registry_host():
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.MULTILINE)
    assert "ARG PIP_EXTRA_ARGS" in text and "${PIP_EXTRA_ARGS}" in text
    assert '".[model]"' in text
    assert 'ENTRYPOINT ["swa-runtime"]' in text
    assert 'CMD ["serve", "--host", "0.0.0.0", "--port", "30000"]' in text
    instructions = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert not any(re.search(r"https?://(?!127\.0\.0\.1)", line) for line in instructions)


def test_dockerignore_keeps_what_the_build_needs():
    ignored = {
        line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for needed in ("runtime", "telemetry", "pyproject.toml", "README.md", "wheels"):
        assert needed not in ignored
    assert {".git", "tests"} <= ignored
