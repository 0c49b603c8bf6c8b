"""dashboards/kubernetes/ and its Prometheus config, checked offline (no cluster here): the manifests against
the Kubernetes API schemas (kubernetes-validate, strict), the wiring between them (labels, ports, probes,
service discovery), and the scrape config with promtool plus its relabelling applied to example pods."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "dashboards" / "kubernetes"
PROM = REPO / "dashboards" / "prometheus"
MANIFESTS = sorted(K8S.glob("*.yaml"))


def docs() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text())}


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def test_manifests_pass_the_kubernetes_schemas_strictly():
    binary = shutil.which("kubernetes-validate")
    if binary is None:
        pytest.skip("kubernetes-validate not installed (pip install kubernetes-validate)")
    result = subprocess.run([binary, "--strict", *map(str, MANIFESTS)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == sum(1 for _ in docs()) >= 10


def test_manifest_check_can_fail(tmp_path):
    binary = shutil.which("kubernetes-validate")
    if binary is None:
        pytest.skip("kubernetes-validate not installed")
    broken = tmp_path / "runtime.yaml"
    broken.write_text((K8S / "runtime.yaml").read_text().replace("periodSeconds: 5", "periodSecond: 5", 1))
    result = subprocess.run([binary, "--strict", str(broken)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "periodSecond" in result.stdout + result.stderr


def test_runtime_probes_ports_and_drain():
    runtime = docs()[("Deployment", "swa-runtime")]
    c = container(runtime)
    assert c["args"][:5] == ["serve", "--host", "0.0.0.0", "--port", "30000"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 30000}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    drain = float(c["args"][c["args"].index("--shutdown-timeout") + 1])
    assert runtime["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain
    assert runtime["spec"]["replicas"] >= 2


def test_router_discovers_exactly_the_runtime_pods():
    d = docs()
    runtime_labels = d[("Deployment", "swa-runtime")]["spec"]["template"]["metadata"]["labels"]
    args = container(d[("Deployment", "swa-router")])["args"]
    rest = args[args.index("--selector") + 1:]
    selector = dict(a.split("=") for a in rest[:next(i for i, a in enumerate(rest) if a.startswith("--"))])
    assert selector and all(runtime_labels.get(k) == v for k, v in selector.items())
    router_labels = d[("Deployment", "swa-router")]["spec"]["template"]["metadata"]["labels"]
    assert not all(router_labels.get(k) == v for k, v in selector.items()), "the router must not discover itself"
    assert "--service-discovery" in args and "--service-discovery-port=30000" in args
    assert "--service-discovery-namespace=$(POD_NAMESPACE)" in args
    binding = d[("RoleBinding", "swa-router")]
    assert binding["subjects"][0]["name"] == d[("Deployment", "swa-router")]["spec"]["template"]["spec"][
        "serviceAccountName"]
    assert set(d[("Role", "swa-router")]["rules"][0]["verbs"]) >= {"list", "watch"}


def test_services_select_their_deployments():
    d = docs()
    for name in ("swa-runtime", "swa-router"):
        pod_labels = d[("Deployment", name)]["spec"]["template"]["metadata"]["labels"]
        assert d[("Service", name)]["spec"]["selector"].items() <= pod_labels.items()


def relabel(config: list[dict], labels: dict[str, str]) -> dict[str, str] | None:
    """Prometheus relabelling for the actions used here (keep, replace), applied to one target."""
    labels = dict(labels)
    for rule in config:
        value = rule.get("separator", ";").join(labels.get(s, "") for s in rule["source_labels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if rule.get("action", "replace") == "keep":
            if not match:
                return None
        elif match:
            labels[rule["target_label"]] = match.expand(rule.get("replacement", r"\1").replace("$1", r"\1"))
    return labels


def pod(name: str, component: str, port_name: str, port: int) -> dict[str, str]:
    return {"__address__": f"10.0.0.7:{port}", "__meta_kubernetes_pod_name": name,
            "__meta_kubernetes_namespace": "llm", "__meta_kubernetes_pod_label_app_kubernetes_io_name": "swa-runtime",
            "__meta_kubernetes_pod_label_app_kubernetes_io_component": component,
            "__meta_kubernetes_pod_container_port_name": port_name,
            "__meta_kubernetes_pod_container_port_number": str(port)}


def test_kubernetes_scrape_config_keeps_each_pod_as_its_own_instance():
    config = yaml.safe_load((PROM / "prometheus-kubernetes.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"swa-runtime", "swa-router"}
    for job in jobs.values():
        assert job["kubernetes_sd_configs"][0]["role"] == "pod"  # pods, never a Service address
    runtime = jobs["swa-runtime"]["relabel_configs"]
    a = relabel(runtime, pod("swa-runtime-5d9c-abcde", "server", "http", 30000))
    b = relabel(runtime, pod("swa-runtime-5d9c-fghij", "server", "http", 30000))
    assert a["instance"] == "swa-runtime-5d9c-abcde:30000" != b["instance"]
    assert a["namespace"] == "llm"
    assert relabel(runtime, pod("swa-router-77-xyz", "router", "metrics", 29000)) is None
    router = relabel(jobs["swa-router"]["relabel_configs"], pod("swa-router-77-xyz", "router", "metrics", 29000))
    assert router["instance"] == "swa-router-77-xyz:29000"
    assert relabel(jobs["swa-router"]["relabel_configs"], pod("swa-router-77-xyz", "router", "http", 30000)) is None


@pytest.mark.promtool
def test_kubernetes_scrape_config_passes_promtool_with_static_discovery(promtool, tmp_path):
    """Debian's promtool is built without Kubernetes discovery: check everything else with the discovery
    swapped for a static target (relabelling, rule files, globals)."""
    config = yaml.safe_load((PROM / "prometheus-kubernetes.yml").read_text())
    for job in config["scrape_configs"]:
        del job["kubernetes_sd_configs"]
        job["static_configs"] = [{"targets": ["127.0.0.1:30000"]}]
    shutil.copytree(PROM / "rules", tmp_path / "rules")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = subprocess.run([promtool, "check", "config", "--lint=all", "prometheus.yml"], capture_output=True,
                            text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 2 rule files found" in result.stdout + result.stderr
