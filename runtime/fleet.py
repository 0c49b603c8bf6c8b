"""`swa-runtime fleet`: N `serve` replicas on loopback behind the SGLang router, on one machine.

It starts and supervises processes and serves the public port; the routing is the router's (`sglang-router`,
cache-aware by default). The router comes up first with no workers; each replica is added through the router's
worker API (`POST /workers`) once its `/health` answers 200.

Supervision: a replica that exits is taken out of the rotation at once (`DELETE /workers/{id}`), restarted on
the same port, so it keeps its Prometheus `instance`, after a backoff (1 s doubling to 30 s, reset once it has
served for a minute), and added back when healthy. Meanwhile the router retries a request that fails to
reach it on another replica. Each replica supervises its own engine process (restarts it, and exits with
status 3 when its restart budget is spent); a serving replica whose `/health` has failed for
`UNHEALTHY_KILL_S` all the same (its engine down and not coming back) is killed and restarted like one that
exited. A serving replica missing from the router's worker list (removed by someone else) is added again. A
replica that exits before it was ever healthy is a configuration error: the fleet stops. The router is
restarted if it exits, and the serving replicas are added to the new one.

Clients reach the fleet through a small front on `--host:--port` (`fleet_front.py`: `serve`'s Host and Origin
checks, the API routes only); the router itself listens on an internal loopback port. Its worker API
(`/workers`: list, add, remove) is its control plane, and even there the fleet starts the router with an
admin key (`SWA_RUNTIME_ADMIN_TOKEN` if set, else a random one) and only callers that present it
(`Authorization: Bearer`) may use it; anyone else gets 401, so a client or a web page cannot take a replica
out or add a worker of its own.

Shutdown (SIGTERM or SIGINT to the fleet): SIGTERM to every replica, each draining like `serve` (no new
requests, running ones finish for `--shutdown-timeout` seconds, the rest are aborted), then SIGTERM to the
router once they have exited. Children run in their own sessions, so a Ctrl-C reaches the fleet only and the
order holds; on Linux they also get SIGTERM if the fleet itself dies.

Cores: replicas on one machine share its cores, and a CPU engine's torch threads that wait for busy cores
stall everyone (measured: 13x slower on a loaded 2-core machine). So unless OMP_NUM_THREADS is set, each
replica gets OMP_NUM_THREADS = cores // replicas (at least 1).
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import structlog

log = structlog.get_logger("swa_runtime.fleet")

POLL_S = 0.2
BACKOFF_S = (1.0, 30.0)  # first restart delay, cap (doubling in between)
STABLE_S = 60.0  # serving this long resets a replica's backoff
REGISTER_TIMEOUT_S = 30.0  # a replica the router has not shown healthy by then is added again
CHECK_S = 1.0  # how often serving replicas' /health and the router's worker list are looked at
# A serving replica whose /health fails this long is killed and restarted: longer than a replica takes to
# kill a hung engine (--engine-hang-kill, 30 s) and restart it, so the replica gets to heal itself first.
UNHEALTHY_KILL_S = 120.0
ADMIN_TOKEN_ENV = "SWA_RUNTIME_ADMIN_TOKEN"
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
ROUTER_JOB, REPLICA_JOB = "swa-router", "swa-runtime"  # the jobs in --prometheus-targets


@dataclass(frozen=True)
class FleetOptions:
    replicas: int
    replica_argv: tuple[str, ...]  # `serve` options every replica gets (engine options, --shutdown-timeout)
    extra_argv: dict[int, tuple[str, ...]] = field(default_factory=dict)  # replica number (from 1) -> options
    host: str = "127.0.0.1"
    port: int = 30000
    router_metrics_port: int | None = None  # None: a free port
    policy: str = "cache_aware"
    router_argv: tuple[str, ...] = ()
    health_check_interval_s: int = 5
    shutdown_timeout_s: float = 30.0
    startup_timeout_s: float = 900.0
    log_dir: Path | None = None
    targets_file: Path | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        unknown = sorted(set(self.extra_argv) - set(range(1, self.replicas + 1)))
        if unknown:
            raise ValueError(f"--replica-args names replica {unknown[0]}; replicas are numbered 1 to {self.replicas}")


def parse_replica_args(specs: list[str], replicas: int) -> dict[int, tuple[str, ...]]:
    """`["1:--inject=x", "*:--max-queued-requests 64"]` -> {1: (...), 2: (...)}: `I:` one replica, `*:` all."""
    out: dict[int, list[str]] = {}
    for spec in specs:
        which, sep, argv = spec.partition(":")
        if not sep or not (which == "*" or which.isdigit()):
            raise ValueError(f"--replica-args wants I:OPTIONS or *:OPTIONS (replicas numbered from 1), got {spec!r}")
        for i in range(1, replicas + 1) if which == "*" else [int(which)]:
            out.setdefault(i, []).extend(shlex.split(argv))
    return {i: tuple(a) for i, a in out.items()}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the fleet dies (Linux), even by SIGKILL."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Child:
    """One supervised process: started in its own session, output to a log file or the fleet's stderr."""

    def __init__(self, name: str, argv: list[str], log_path: Path | None, env: dict[str, str] | None = None):
        self.name, self.argv, self.log_path, self.env = name, argv, log_path, env
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        out = self.log_path.open("ab") if self.log_path is not None else None
        try:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT if out else None,
                                         stdin=subprocess.DEVNULL, start_new_session=True, env=self.env,
                                         preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        finally:
            if out is not None:
                out.close()

    @property
    def exited(self) -> int | None:
        """The exit status once it has exited (None while it runs or before it started)."""
        return None if self.proc is None else self.proc.poll()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        if self.running:
            self.proc.send_signal(signal.SIGTERM)

    def wait_or_kill(self, deadline: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("fleet_child_killed", child=self.name, why="did not exit in time")
            self.proc.kill()
            self.proc.wait()


@dataclass
class Replica:
    number: int
    port: int
    child: Child
    state: str = "down"  # down -> starting -> registering -> serving -> down ...
    state_since: float = 0.0
    restart_at: float = 0.0
    backoff_s: float = BACKOFF_S[0]
    serving_since: float | None = None
    ever_healthy: bool = False
    unhealthy_since: float | None = None  # serving, but /health failing since

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class RouterClient:
    """The router's worker API: GET /workers, POST /workers {"url"}, DELETE /workers/{id}, with the admin key."""

    def __init__(self, url: str, admin_key: str, timeout_s: float = 5.0):
        self.url, self.timeout_s = url, timeout_s
        self._auth = {"Authorization": f"Bearer {admin_key}"}

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        headers = {**self._auth, **({"Content-Type": "application/json"} if data else {})}
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            return json.loads(r.read() or b"{}")

    def workers(self) -> dict[str, dict]:
        """Registered workers by URL (each with `id` and `is_healthy`)."""
        return {w["url"]: w for w in self._call("GET", "/workers")["workers"]}

    def add(self, url: str) -> None:
        self._call("POST", "/workers", {"url": url})

    def remove(self, url: str) -> None:
        worker = self.workers().get(url)
        if worker is not None:
            self._call("DELETE", f"/workers/{worker['id']}")


def _get_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


class Fleet:
    def __init__(self, opts: FleetOptions):
        self.opts = opts
        self.stopping = False
        metrics_port = opts.router_metrics_port or free_port(opts.host)
        self.public_url = f"http://{opts.host}:{opts.port}"
        self.router_url = f"http://127.0.0.1:{free_port()}"  # internal (loopback): the front and the fleet call it
        self.router_metrics = f"{opts.host}:{metrics_port}"
        self.admin_key = os.environ.get(ADMIN_TOKEN_ENV) or secrets.token_urlsafe(24)
        self.router = Child("router", self._router_argv(metrics_port), self._log("router"))
        self.client = RouterClient(self.router_url, self.admin_key)
        self._checked_at = 0.0
        self.replicas = []
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // opts.replicas)))
        for i in range(1, opts.replicas + 1):
            port = free_port()
            argv = [sys.executable, "-m", "runtime", "serve", "--host", "127.0.0.1", "--port", str(port),
                    "--shutdown-timeout", str(opts.shutdown_timeout_s), *opts.replica_argv, *opts.extra_argv.get(i, ())]
            self.replicas.append(Replica(i, port, Child(f"replica-{i}", argv, self._log(f"replica-{i}"), env)))

    def _log(self, name: str) -> Path | None:
        return None if self.opts.log_dir is None else self.opts.log_dir / f"{name}.log"

    def _router_argv(self, metrics_port: int) -> list[str]:
        o = self.opts
        internal_port = self.router_url.rsplit(":", 1)[1]
        return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", internal_port,
                "--policy", o.policy, "--prometheus-host", o.host, "--prometheus-port", str(metrics_port),
                "--health-check-interval-secs", str(o.health_check_interval_s), "--health-failure-threshold", "2",
                "--health-success-threshold", "1", "--shutdown-grace-period-secs", str(int(o.shutdown_timeout_s)),
                "--control-plane-api-keys", f"fleet:swa-runtime fleet:admin:{self.admin_key}",
                "--log-level", "warn", *o.router_argv]

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def run(self) -> int:
        """Start everything, supervise until SIGTERM/SIGINT, then drain and stop. Returns the exit status."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        if self.opts.log_dir is not None:
            self.opts.log_dir.mkdir(parents=True, exist_ok=True)
        self._write_targets()
        self.router.start()
        front = self._start_front()
        for r in self.replicas:
            self._start(r)
        status, ready, deadline = 0, False, time.monotonic() + self.opts.startup_timeout_s
        while not self.stopping:
            if self.router.exited is not None:
                self._restart_router()
            for r in self.replicas:
                if not self._supervise(r):
                    status, self.stopping = 1, True
            if time.monotonic() - self._checked_at >= CHECK_S:
                self._checked_at = time.monotonic()
                self._check_serving()
            if not ready and all(r.state == "serving" for r in self.replicas):
                ready = True
                print(f"swa-runtime fleet: {len(self.replicas)} replicas ({', '.join(r.url for r in self.replicas)}) "
                      f"behind the router on {self.public_url} (router internally: {self.router_url}, metrics: "
                      f"http://{self.router_metrics}"
                      "/metrics)", file=sys.stderr, flush=True)
            if not ready and time.monotonic() > deadline:
                log.error("fleet_startup_timed_out", waited_s=self.opts.startup_timeout_s)
                status, self.stopping = 1, True
            time.sleep(POLL_S)
        self._shutdown()
        front.should_exit = True
        return status

    def _start_front(self):
        """The public port, in a thread of this process (see the module docstring)."""
        import uvicorn

        from runtime.fleet_front import create_front
        from runtime.server.site_guard import SitePolicy

        app = create_front(self.router_url, SitePolicy(self.opts.host))
        server = uvicorn.Server(uvicorn.Config(app, host=self.opts.host, port=self.opts.port, log_level="warning",
                                               lifespan="on", timeout_keep_alive=5))
        thread = threading.Thread(target=server.run, name="fleet-front", daemon=True)
        thread.start()
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"the fleet's public port {self.opts.host}:{self.opts.port} could not be bound")
            time.sleep(0.05)
        return server

    def _on_signal(self, signum, frame) -> None:
        self.stopping = True

    def _shutdown(self) -> None:
        """Replicas first (each drains like `serve`), then the router."""
        for r in self.replicas:
            r.child.terminate()
        deadline = time.monotonic() + self.opts.shutdown_timeout_s + 30.0
        for r in self.replicas:
            r.child.wait_or_kill(deadline)
        self.router.terminate()
        self.router.wait_or_kill(time.monotonic() + 15.0)

    # ---- supervision -------------------------------------------------------------------------------------
    def _start(self, r: Replica) -> None:
        r.child.start()
        self._enter(r, "starting")

    @staticmethod
    def _enter(r: Replica, state: str) -> None:
        r.state, r.state_since = state, time.monotonic()

    def _supervise(self, r: Replica) -> bool:
        """One look at a replica; False when the fleet cannot go on (a replica that never came up died)."""
        now = time.monotonic()
        code = r.child.exited
        if code is not None and r.state != "down":
            if not r.ever_healthy:
                log.error("fleet_replica_failed_to_start", replica=r.number, exit_status=code, url=r.url)
                return False
            log.warning("fleet_replica_exited", replica=r.number, exit_status=code, url=r.url,
                        restart_in_s=r.backoff_s)
            self._try(self.client.remove, r.url)
            if r.serving_since is not None and now - r.serving_since >= STABLE_S:
                r.backoff_s = BACKOFF_S[0]
            self._enter(r, "down")
            r.restart_at, r.serving_since = now + r.backoff_s, None
            r.backoff_s = min(BACKOFF_S[1], r.backoff_s * 2)
        elif r.state == "down" and now >= r.restart_at:
            log.warning("fleet_replica_restarting", replica=r.number, url=r.url)
            self._start(r)
        elif r.state == "starting" and _get_ok(r.url + "/health"):
            r.ever_healthy = True
            if self._try(self.client.add, r.url):
                self._enter(r, "registering")
        elif r.state == "registering":
            worker = self._try(self.client.workers, default={}).get(r.url)
            if worker is not None and worker.get("is_healthy"):
                log.info("fleet_replica_serving", replica=r.number, url=r.url)
                self._enter(r, "serving")
                r.serving_since = now
            elif now - r.state_since > REGISTER_TIMEOUT_S:
                self._enter(r, "starting")
        return True

    def _check_serving(self) -> None:
        """Serving replicas: add back one the router lost; kill one whose /health has failed too long."""
        serving = [r for r in self.replicas if r.state == "serving"]
        if not serving:
            return
        registered = self._try(self.client.workers)
        now = time.monotonic()
        for r in serving:
            if isinstance(registered, dict) and r.url not in registered:
                log.warning("fleet_replica_missing_from_router", replica=r.number, url=r.url)
                if self._try(self.client.add, r.url):
                    self._enter(r, "registering")
                continue
            if _get_ok(r.url + "/health"):
                r.unhealthy_since = None
            elif r.unhealthy_since is None:
                r.unhealthy_since = now
            elif now - r.unhealthy_since >= UNHEALTHY_KILL_S:
                log.error("fleet_replica_unhealthy_killed", replica=r.number, url=r.url,
                          unhealthy_s=round(now - r.unhealthy_since))
                r.unhealthy_since = None
                r.child.proc.kill()  # the next look sees it exit and restarts it

    def _restart_router(self) -> None:
        log.warning("fleet_router_exited", exit_status=self.router.exited)
        self.router.start()
        deadline = time.monotonic() + 30.0
        while not _get_ok(self.router_url + "/health") and time.monotonic() < deadline and not self.stopping:
            time.sleep(POLL_S)
        for r in self.replicas:
            if r.state in ("registering", "serving"):
                self._enter(r, "starting")  # added again once the new router answers

    def _try(self, fn, *args, default=None):
        """Call the router; a failure (it is starting or restarting) is retried by the next look."""
        try:
            result = fn(*args)
            return True if result is None else result
        except (OSError, urllib.error.URLError, ValueError, KeyError) as exc:
            log.debug("fleet_router_call_failed", call=fn.__name__, error=str(exc))
            return default

    def _write_targets(self) -> None:
        """Prometheus file_sd targets: the replicas (job swa-runtime) and the router's metrics (job swa-router)."""
        if self.opts.targets_file is None:
            return
        groups = [{"targets": [f"127.0.0.1:{r.port}" for r in self.replicas], "labels": {"job": REPLICA_JOB}},
                  {"targets": [self.router_metrics], "labels": {"job": ROUTER_JOB}}]
        tmp = self.opts.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups, indent=2) + "\n")
        os.replace(tmp, self.opts.targets_file)  # Prometheus never reads a half-written file


# ---- command line ------------------------------------------------------------------------------------------
def add_fleet_args(p) -> None:
    """Options of `swa-runtime fleet` besides the engine options (which every replica gets)."""
    g = p.add_argument_group("fleet")
    g.add_argument("--replicas", type=int, default=2,
                   help="`serve` replicas on free loopback ports (default 2), each with OMP_NUM_THREADS = cores / "
                        "replicas unless it is set")
    g.add_argument("--host", default="127.0.0.1",
                   help="address of the fleet's public port (default 127.0.0.1); the router itself stays on loopback")
    g.add_argument("--port", type=int, default=30000, help="the fleet's public port (default 30000)")
    g.add_argument("--router-metrics-port", type=int, default=None, metavar="PORT",
                   help="the router's Prometheus port (default: a free one)")
    g.add_argument("--policy", choices=ROUTER_POLICIES, default="cache_aware", help="the router's policy")
    g.add_argument("--router-arg", action="append", default=[], metavar="OPTION",
                   help="an option passed to the router as is (repeatable), e.g. --router-arg=--cache-threshold=0.5")
    g.add_argument("--replica-args", action="append", default=[], metavar="I:OPTIONS",
                   help="`serve` options for replica I only (numbered from 1), or `*:` for every replica "
                        "(repeatable), e.g. --replica-args '1:--inject skip-forward-invalidation'")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT each replica lets running requests finish this long")
    g.add_argument("--health-check-interval", type=int, default=5, metavar="SECONDS",
                   help="how often the router checks each replica's /health")
    g.add_argument("--startup-timeout", type=float, default=900.0, metavar="SECONDS",
                   help="give up when the replicas are not all serving by then")
    g.add_argument("--log-dir", type=Path, default=None,
                   help="write replica-I.log and router.log there (default: this process's stderr)")
    g.add_argument("--prometheus-targets", type=Path, default=None, metavar="FILE",
                   help="write the replicas and the router's metrics endpoint there as Prometheus file_sd targets")


def run_fleet(args) -> int:
    from runtime.options import engine_argv
    from telemetry.logging import configure_logging

    configure_logging(args.log_format, args.log_level)
    opts = FleetOptions(
        replicas=args.replicas, replica_argv=tuple(engine_argv(args)),
        extra_argv=parse_replica_args(args.replica_args, args.replicas), host=args.host, port=args.port,
        router_metrics_port=args.router_metrics_port, policy=args.policy, router_argv=tuple(args.router_arg),
        health_check_interval_s=args.health_check_interval, shutdown_timeout_s=args.shutdown_timeout,
        startup_timeout_s=args.startup_timeout, log_dir=args.log_dir, targets_file=args.prometheus_targets)
    return Fleet(opts).run()
