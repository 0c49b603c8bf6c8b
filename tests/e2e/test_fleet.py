"""`swa-runtime fleet` end to end on loopback: two tiny replicas behind the real SGLang router, a real
Prometheus scraping both replicas and the router (the fleet's file_sd targets) with our rules.

In order, on one fleet: 40 concurrent requests through the router are spread over both replicas (each
replica's own /metrics says it served some) and equal a single replica's outputs; every query of the fleet
dashboard returns data, per instance where it breaks down by instance; a fault injected into replica 2 only
fires the alert for replica 2 alone; a client leaving the router aborts the request on its replica; killing
replica 1 mid-run loses no request that had not started on it, the survivor finishes everything, and the
fleet brings replica 1 back; the public port refuses foreign sites and the router's worker API, which itself
refuses callers without the admin key; a replica removed from the router is added back; a replica's engine
killed mid-load heals in place; SIGTERM stops everything in order. Bounded in time throughout."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dashboards.generate import FLEET_OUTPUT
from runtime.diagnose.from_log import diagnose_logs
from dashboards.snapshot import Prometheus, fetch
from live_helpers import free_port, prom_query, start_prometheus, stop, wait_for

pytestmark = [pytest.mark.promtool, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
FAULTS = ("skip-forward-invalidation", "skip-alloc-invalidation")  # as the live-stack test: events on decode
PROMPTS = [f"request {i}: " + "the quick brown fox jumps over the lazy dog "[i % 7:] * (1 + i % 3) for i in range(40)]
NEW_TOKENS = 8
BUG_ALERTS = ("SWARuntimeStaleLoc", "SWARuntimeMissingInvalidation", "SWARuntimeLocKeyCollision")


def post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode(errors="replace")}
    except OSError as exc:
        return 0, {"error": repr(exc)}


def generate(base: str, prompt: str) -> tuple[int, dict]:
    return post(f"{base}/generate", {"text": prompt, "sampling_params": {"max_new_tokens": NEW_TOKENS,
                                                                        "ignore_eos": True}})


def samples(url: str) -> dict[tuple[str, tuple], float]:
    """A replica's /metrics as {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def requests_by_status(url: str, status: str) -> float:
    return samples(url)[("swa_runtime_requests_total", (("status", status),))]


ADMIN_KEY = "fleet-admin-key-for-tests-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def router_call(url: str, method: str = "GET", headers: dict | None = None, body: dict | None = None):
    """(status, parsed body) of a call to the router's worker API."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={**(headers or {}), **({"Content-Type": "application/json"} if data else {})})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def workers(router: str) -> dict[str, bool]:
    status, body = router_call(f"{router}/workers", headers=ADMIN)
    assert status == 200, body
    return {w["url"]: w["is_healthy"] for w in body["workers"]}


def worker_ids(router: str) -> dict[str, str]:
    return {w["url"]: w["id"] for w in router_call(f"{router}/workers", headers=ADMIN)[1]["workers"]}


def serve_pid(port: int) -> int:
    """The pid of the `serve` process listening on `port` (the fleet's child)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"serve" in argv and b"--port" in argv and argv[argv.index(b"--port") + 1] == str(port).encode():
                return int(entry)
    raise AssertionError(f"no serve process on port {port}")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    work = tmp_path_factory.mktemp("fleet")
    port, targets = free_port(), work / "targets.json"
    cmd = [sys.executable, "-m", "runtime", "fleet", "--replicas", "2", "--model", "tiny", "--port", str(port),
           "--max-total-tokens", "2048", "--health-check-interval", "1", "--shutdown-timeout", "10",
           "--log-dir", str(work / "logs"), "--prometheus-targets", str(targets), "--log-level", "INFO", "--log-format", "json",
           "--replica-args", "2:" + " ".join(f"--inject {f}" for f in FAULTS)]
    out = (work / "fleet.out").open("w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, "SWA_RUNTIME_ADMIN_TOKEN": ADMIN_KEY})
    router = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: targets.exists(), 60, "the fleet's targets file")
        groups = {g["labels"]["job"]: g["targets"] for g in json.loads(targets.read_text())}
        replicas = [f"http://{t}" for t in groups["swa-runtime"]]
        scrape = f"  - job_name: fleet\n    file_sd_configs: [{{files: ['{targets}'], refresh_interval: 1s}}]\n"
        prom, prom_url = start_prometheus(work / "prometheus", None, scrape_configs=scrape)
    except BaseException:
        stop(proc)
        raise
    try:
        wait_for(lambda: proc.poll() is None and "behind the router" in (work / "fleet.out").read_text(), 300,
                 "the fleet to serve")
        internal = re.search(r"router internally: (http://127\.0\.0\.1:\d+)", (work / "fleet.out").read_text())[1]
        wait_for(lambda: len(prom_query(prom_url, "up == 1")) == 3, 60, "Prometheus scraping 2 replicas + router")
        yield {"proc": proc, "router": router, "internal": internal, "replicas": replicas, "prom": prom_url,
               "work": work,
               "instances": [r.removeprefix("http://") for r in replicas], "reference": {}}
    finally:
        stop(proc, timeout=60)
        stop(prom)


def references(fleet, prompts) -> dict:
    """Each prompt's output from the replica without the injected fault, asked directly: the test that spreads
    requests over both replicas records them; a test run alone asks for those it needs (before it kills anything)."""
    missing = [p for p in prompts if p not in fleet["reference"]]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: generate(fleet["replicas"][0], p), missing))
    assert all(status == 200 for status, _ in answers)
    fleet["reference"].update({p: body["output_ids"] for p, (_, body) in zip(missing, answers)})
    return fleet["reference"]


def test_prometheus_sees_each_replica_and_the_router_under_its_job(fleet):
    up = {(r["metric"]["job"], r["metric"]["instance"]) for r in prom_query(fleet["prom"], "up == 1")}
    assert {i for job, i in up if job == "swa-runtime"} == set(fleet["instances"])
    assert len([i for job, i in up if job == "swa-router"]) == 1


def test_requests_spread_over_both_replicas_and_equal_a_single_replicas(fleet):
    with ThreadPoolExecutor(40) as pool:
        routed = list(pool.map(lambda p: generate(fleet["router"], p), PROMPTS))
    assert [status for status, _ in routed] == [200] * 40, [b for s, b in routed if s != 200][:3]
    served = [requests_by_status(url, "finished") for url in fleet["replicas"]]
    assert sum(served) == 40 and min(served) > 0, served  # each replica served some
    single = fleet["replicas"][0]  # the replica without the injected fault, asked directly
    with ThreadPoolExecutor(8) as pool:
        direct = list(pool.map(lambda p: generate(single, p), PROMPTS))
    assert all(status == 200 for status, _ in direct)
    fleet["reference"].update({p: body["output_ids"] for p, (_, body) in zip(PROMPTS, direct)})
    assert [body["output_ids"] for _, body in routed] == [fleet["reference"][p] for p in PROMPTS]
    assert all(len(body["output_ids"]) == NEW_TOKENS for _, body in routed)


def test_fleet_dashboard_queries_return_data_per_instance(fleet):
    time.sleep(3)  # a few more scrapes after the traffic
    board = json.loads(FLEET_OUTPUT.read_text())
    panels = {p.title: p for p in fetch(Prometheus(fleet["prom"]), board, end=time.time(), range_s=90,
                                        rate_interval="10s", job="swa-runtime", router_job="swa-router")}
    assert len(panels) >= 18
    assert {t: (p.errors, p.empty_targets) for t, p in panels.items() if p.errors or p.empty_targets} == {}
    per_instance = [t for t in panels if t.endswith("by instance")]
    assert len(per_instance) >= 6
    for title in per_instance + ["Replicas"]:
        assert {s.labels.get("instance") for s in panels[title].series} >= set(fleet["instances"]), title
    healthy = panels["Replicas healthy in the router"].series
    assert sorted(s.labels["worker"] for s in healthy) == sorted(fleet["replicas"])
    assert all(s.values[-1] == 1 for s in healthy)


def test_fault_on_one_replica_fires_the_alert_for_that_instance_alone(fleet):
    faulty, clean = fleet["instances"][1], fleet["instances"][0]
    firing = 'ALERTS{alertname="SWARuntimeMissingInvalidation", alertstate="firing"}'
    wait_for(lambda: prom_query(fleet["prom"], firing), 30, "the alert to fire")
    assert {r["metric"]["instance"] for r in prom_query(fleet["prom"], firing)} == {faulty}
    names = "|".join(BUG_ALERTS)
    assert prom_query(fleet["prom"], f'ALERTS{{alertname=~"{names}", instance="{clean}"}}') == []
    with urllib.request.urlopen(f"{fleet['prom']}/api/v1/alerts", timeout=5) as r:
        alerts = [a for a in json.load(r)["data"]["alerts"] if a["labels"]["alertname"] in BUG_ALERTS]
    assert alerts and all(faulty in a["annotations"]["summary"] and clean not in a["annotations"]["summary"]
                          for a in alerts)
    # the logs say the same: every replica's records name it, and diagnose attributes the events to it alone
    logs = [str(fleet["work"] / "logs" / f"replica-{i}.log") for i in (1, 2)]
    rows = diagnose_logs(logs).as_dict()["rows"]
    assert rows and {r["instance"] for r in rows} == {faulty}
    assert {r["classification"] for r in rows} <= {"cross_forward", "stale_loc", "benign_fresh_tensor"}


def test_a_client_leaving_the_router_aborts_its_request_on_the_replica(fleet):
    before = sum(requests_by_status(url, "aborted") for url in fleet["replicas"])
    body = {"text": "a long answer nobody waits for", "stream": True,
            "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    req = urllib.request.Request(f"{fleet['router']}/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.readline().startswith(b"data: ")  # it runs on some replica; now leave
    wait_for(lambda: sum(requests_by_status(url, "aborted") for url in fleet["replicas"]) == before + 1, 30,
             "the replica to abort the request")
    for url in fleet["replicas"]:
        wait_for(lambda: samples(url)[("swa_runtime_num_running_reqs", ())] == 0, 30, "no request left running")
        assert samples(url)[("swa_runtime_num_queue_reqs", ())] == 0


def load_with_a_kill(fleet, pid: int) -> tuple[dict[int, tuple[float, float, int, dict]], float]:
    """40 requests through the router, 6 at a time; SIGKILL to `pid` once 5 are answered. Returns
    {index: (sent, answered, status, body)} and the time of the kill."""
    results: dict[int, tuple[float, float, int, dict]] = {}
    killed_at: list[float] = []

    def send(i: int) -> None:
        sent = time.monotonic()
        status, body = generate(fleet["router"], PROMPTS[i])
        results[i] = (sent, time.monotonic(), status, body)

    def kill_when_running() -> None:
        wait_for(lambda: len(results) >= 5, 120, "the first answers")
        os.kill(pid, signal.SIGKILL)
        killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill_when_running)
    killer.start()
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(send, range(40)))
    killer.join(60)
    (kill,) = killed_at
    return results, kill


def test_killing_a_replica_loses_no_request_that_had_not_started_on_it(fleet):
    victim, survivor = fleet["replicas"]
    reference = references(fleet, PROMPTS)
    finished_before = requests_by_status(survivor, "finished")
    results, kill = load_with_a_kill(fleet, serve_pid(int(victim.rsplit(":", 1)[1])))
    in_flight = [i for i, (sent, answered, _, _) in results.items() if sent < kill < answered]
    failed = [i for i, (_, _, status, _) in results.items() if status != 200]
    assert set(failed) <= set(in_flight), "only requests running when the replica died may fail"
    after = [i for i, (sent, _, _, _) in results.items() if sent > kill]
    assert after and all(results[i][2] == 200 for i in after)
    for i, (_, _, status, body) in results.items():
        if status == 200:
            assert body["output_ids"] == reference[PROMPTS[i]], i
    # the survivor took over (the victim, restarted within seconds, may get some of the last ones too) and
    # holds nothing once done
    assert requests_by_status(survivor, "finished") > finished_before
    print(f"kill mid-run: {len(in_flight)} in flight at the kill, {len(failed)} failed, {len(after)} sent after it")
    wait_for(lambda: samples(survivor)[("swa_runtime_num_running_reqs", ())] == 0, 30, "the survivor to idle")
    # the fleet restarts the victim on the same port and the router routes to it again
    wait_for(lambda: workers(fleet["internal"]) == {victim: True, survivor: True}, 180, "the victim to serve again")
    status, body = generate(victim, PROMPTS[0])
    assert status == 200 and body["output_ids"] == reference[PROMPTS[0]]
    events = [json.loads(line) for line in (fleet["work"] / "fleet.out").read_text().splitlines()
              if line.startswith("{")]
    assert [(e["replica"], e["exit_status"]) for e in events if e["event"] == "fleet_replica_exited"] == [(1, -9)]
    assert [e["replica"] for e in events if e["event"] == "fleet_replica_restarting"] == [1]


def test_the_public_port_refuses_foreign_sites_and_the_worker_api(fleet):
    public, ids = fleet["router"], worker_ids(fleet["internal"])
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    for headers in ({"Origin": "http://evil.example"}, {"Host": "evil.example"}):
        status, answer = router_call(f"{public}/generate", "POST", headers, body)
        assert status == 403 and "evil.example" in answer
        assert router_call(f"{public}/workers/{next(iter(ids.values()))}", "DELETE", {**headers, **ADMIN})[0] == 403
    for method, path in (("GET", "/workers"), ("POST", "/workers"), ("DELETE", f"/workers/{next(iter(ids.values()))}"),
                         ("POST", "/flush_cache"), ("GET", "/get_loads")):
        status, answer = router_call(f"{public}{path}", method, ADMIN, {"url": "http://127.0.0.1:9"} if method == "POST"
                                     else None)
        assert status == 404 and "public port" in answer, (method, path)
    assert worker_ids(fleet["internal"]) == ids  # routing unchanged
    assert all(generate(public, p)[0] == 200 for p in PROMPTS[:4])


def test_the_routers_worker_api_refuses_callers_without_the_admin_key(fleet):
    router = fleet["internal"]
    ids = worker_ids(router)
    evil = {"Origin": "http://evil.example", "Host": "evil.example"}
    for headers in ({}, evil, {"Authorization": "Bearer guessed"}):
        assert router_call(f"{router}/workers", headers=headers)[0] == 401
        assert router_call(f"{router}/workers", "POST", headers, {"url": "http://127.0.0.1:9"})[0] == 401
        for worker_id in ids.values():
            assert router_call(f"{router}/workers/{worker_id}", "DELETE", headers)[0] == 401
    assert workers(router) == {url: True for url in fleet["replicas"]}  # routing unchanged
    assert all(generate(fleet["router"], p)[0] == 200 for p in PROMPTS[:4])


def test_a_replica_removed_from_the_router_is_added_back(fleet):
    router, (first, _) = fleet["internal"], fleet["replicas"]
    assert router_call(f"{router}/workers/{worker_ids(router)[first]}", "DELETE", ADMIN)[0] < 300
    wait_for(lambda: workers(router) == {url: True for url in fleet["replicas"]}, 60, "the replica added back")


def test_killing_a_replicas_engine_mid_load_heals_in_place(fleet):
    """The replica restarts its own engine process: only requests running on it fail, both replicas serve
    again, and the restart is counted on the victim."""
    victim = fleet["replicas"][0]
    reference = references(fleet, PROMPTS[:1])
    serve = serve_pid(int(victim.rsplit(":", 1)[1]))
    engine = next(int(p) for p in Path(f"/proc/{serve}/task/{serve}/children").read_text().split()
                  if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes())
    results, kill = load_with_a_kill(fleet, engine)
    in_flight = {i for i, (sent, answered, _, _) in results.items() if sent < kill < answered}
    failed = {i for i, (_, _, status, _) in results.items() if status != 200}
    assert failed <= in_flight, "only requests running when the engine died may fail"
    wait_for(lambda: samples(victim)[("swa_runtime_engine_up", ())] == 1, 120, "the engine restarted")
    assert samples(victim)[("swa_runtime_engine_restarts_total", ())] == 1
    wait_for(lambda: workers(fleet["internal"]) == {url: True for url in fleet["replicas"]}, 120, "both serving")
    assert serve_pid(int(victim.rsplit(":", 1)[1])) == serve  # healed in place, not restarted by the fleet
    assert generate(victim, PROMPTS[0])[1]["output_ids"] == reference[PROMPTS[0]]


def test_sigterm_stops_the_replicas_then_the_router(fleet):
    proc = fleet["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    for url in [*fleet["replicas"], fleet["router"], fleet["internal"]]:
        with pytest.raises(OSError):
            urllib.request.urlopen(f"{url}/health", timeout=2)


def test_replica_args_name_one_replica_or_all():
    from runtime.fleet import parse_replica_args

    assert parse_replica_args(["2:--inject a --inject b", "*:--max-queued-requests 8"], 2) == {
        1: ("--max-queued-requests", "8"), 2: ("--inject", "a", "--inject", "b", "--max-queued-requests", "8")}
    with pytest.raises(ValueError, match="I:OPTIONS"):
        parse_replica_args(["--inject a"], 2)


def test_a_replica_that_never_comes_up_stops_the_fleet(tmp_path):
    """A configuration error (here a model that does not exist) is not restarted forever: the fleet stops the
    router and exits with status 1."""
    cmd = [sys.executable, "-m", "runtime", "fleet", "--replicas", "1", "--model", str(tmp_path / "missing.gguf"),
           "--port", str(free_port()), "--log-dir", str(tmp_path / "logs")]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "fleet_replica_failed_to_start" in result.stderr
    assert "missing.gguf" in (tmp_path / "logs" / "replica-1.log").read_text()
