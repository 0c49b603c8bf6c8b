"""docker-compose.yml, the Dockerfiles and their mounts. No Docker engine runs here, so the files are parsed
and cross-checked: every mounted path exists, and the services agree on names, ports and paths: each replica
is scraped by its own name (its series keep their own `instance`), the router calls the same names, and
Prometheus scrapes the router's metrics port."""

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


def replicas(compose: dict) -> dict[str, dict]:
    return {name: svc for name, svc in compose["services"].items() if name.startswith("runtime-")}


def scrape_targets(job_name: str) -> list[str]:
    scrape = yaml.safe_load((REPO / "dashboards" / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in scrape["scrape_configs"] if j["job_name"] == job_name)
    return [t for group in job["static_configs"] for t in group["targets"]]


def flag(command: list[str], name: str) -> list[str]:
    """The values after `name` up to the next option."""
    i = command.index(name) + 1
    values = []
    while i < len(command) and not command[i].startswith("--"):
        values.append(command[i])
        i += 1
    return values


def test_services_present(compose):
    assert {"runtime-1", "runtime-2", "router", "prometheus", "grafana"} <= set(compose["services"])


def test_every_bind_mount_exists(compose):
    mounts = [m for svc in compose["services"].values() for m in bind_mounts(svc)]
    assert len(mounts) >= 5
    for source, _ in mounts:
        assert (REPO / source).exists(), f"compose mounts missing path {source}"


def test_each_replica_is_scraped_and_routed_by_its_own_name(compose):
    services = replicas(compose)
    assert len(services) == 2
    names = []
    for name, svc in services.items():
        assert svc["build"]["context"] == "." and (REPO / svc["build"]["dockerfile"]).is_file()
        assert svc["image"] == "swa-runtime:local"
        command = svc["command"]
        assert command[:5] == ["serve", "--host", "0.0.0.0", "--port", "30000"]
        # the router and Prometheus call it by its hostname, which the Host check must let through, and which
        # it logs as its instance (a wildcard bind logs the host name)
        assert svc["hostname"] == name and flag(command, "--allowed-hosts") == [name]
        names.append(f"{name}:30000")
        assert [v.split(":")[1] for v in svc["volumes"]] == ["/home/swa/.cache"]
    assert scrape_targets("swa-runtime") == names  # one target per replica: series never mix two replicas
    router = compose["services"]["router"]["command"]
    assert flag(router, "--worker-urls") == [f"http://{n}" for n in names]
    assert scrape_targets("swa-router") == [f"router:{flag(router, '--prometheus-port')[0]}"]
    caches = [v.split(":")[0] for svc in services.values() for v in svc["volumes"]]
    assert len(set(caches)) == len(caches), "replicas assembling the model into one cache volume would race"


def test_router_image_pins_the_version_the_tests_run(compose):
    router = compose["services"]["router"]
    dockerfile = (REPO / router["build"]["context"] / "Dockerfile").read_text()
    pinned = re.search(r"sglang-router==([\d.]+)", dockerfile).group(1)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"sglang-router=={pinned}"' in pyproject
    assert router["image"] == f"swa-router:{pinned}"
    assert 'ENTRYPOINT ["python", "-m", "sglang_router.launch_router"]' in dockerfile


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
    assert '".[model,server]"' in text  # serve needs the server extra
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
