"""Throughput of `swa-runtime fleet` with 1 replica and with N, side by side in one run, through the router.

Each setting starts a fresh fleet on loopback, warms it up, then sends the same requests (distinct text
prompts, greedy, `--new-tokens` each, `--concurrency` at a time) and times them. Prints generated tokens per
second per setting and the ratio to one replica: with the fleet's default torch threads (cores / replicas
each) and with one thread per replica. Replicas share this machine's cores: on a machine with C
cores, N replicas of a CPU engine each get C/N of them, so the ratio says what routing costs and what
overlapping one replica's HTTP and scheduling gaps with another's compute gains, not what N machines give.

    python benchmarks/fleet_throughput.py [--replicas 2] [--requests 48] [--concurrency 16] [--model tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generate(url: str, prompt: str, new_tokens: int) -> int:
    body = json.dumps({"text": prompt, "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True}})
    req = urllib.request.Request(f"{url}/generate", body.encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return len(json.load(r)["output_ids"])


def measure(args: argparse.Namespace, replicas: int, threads: int | None) -> float:
    """Generated tokens per second of a fresh fleet of `replicas` (torch threads per replica: `threads`)."""
    port = free_port()
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    with tempfile.TemporaryDirectory() as logs:
        cmd = [sys.executable, "-m", "runtime", "fleet", "--replicas", str(replicas), "--model", args.model,
               "--port", str(port), "--log-dir", logs, "--max-running-requests", str(args.concurrency)]
        fleet = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
        try:
            for line in fleet.stderr:
                if "behind the router" in line:
                    break
            else:
                raise RuntimeError(f"the fleet exited with status {fleet.wait()}")
            url = f"http://127.0.0.1:{port}"
            prompts = [f"benchmark request {i}: " + "a sliding window keeps the recent tokens " * 2
                       for i in range(args.requests)]
            with ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(lambda p: generate(url, p, 4), prompts[: args.concurrency]))  # warm-up
                start = time.perf_counter()
                tokens = sum(pool.map(lambda p: generate(url, p, args.new_tokens), prompts))
                return tokens / (time.perf_counter() - start)
        finally:
            fleet.send_signal(signal.SIGTERM)
            fleet.wait(120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--model", default="tiny")
    args = p.parse_args()
    cores = os.cpu_count() or 1
    # the fleet's default threads (cores / replicas), and one thread per replica; each against one replica with
    # the same setting, and against the best single replica (the honest baseline)
    settings = [(1, None), (args.replicas, None), (1, 1), (args.replicas, 1)]
    results = {(n, t): measure(args, n, t) for n, t in settings}
    best_single = max(tps for (n, _), tps in results.items() if n == 1)
    print(f"{args.requests} requests x {args.new_tokens} tokens, {args.concurrency} concurrent, model {args.model}, "
          f"{cores} cores")
    print("replicas  torch threads/replica  tokens/s  vs 1 replica (same setting)  vs best 1 replica")
    for (n, t), tps in results.items():
        print(f"{n:>8}  {t if t else max(1, cores // n):>21}  {tps:>8.1f}  {tps / results[(1, t)]:>27.2f}x"
              f"  {tps / best_single:>16.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
