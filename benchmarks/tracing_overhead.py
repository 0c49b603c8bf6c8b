"""What tracing costs the engine, side by side in one run: engine steps with tracing off, with tracing on
(exporting to a loopback collector that discards the spans), and optionally off on another checkout of the
code (`--baseline PATH`, e.g. the commit before tracing existed: `git archive REV | tar -x -C PATH`).

Each setting runs in its own process (torch on one thread), builds a tiny-model engine, warms up, then times
`--rounds` rounds of the same workload (`--requests` greedy requests, `--new-tokens` each); rounds of the
settings interleave so that a noisy machine slows them alike. Prints the median seconds per engine step and
the ratio to tracing off.

    python benchmarks/tracing_overhead.py [--rounds 8] [--requests 8] [--new-tokens 32] [--baseline PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
from runtime.config import EngineConfig
from runtime.core import Req, SamplingParams
from runtime.engine import Engine
endpoint, requests, new_tokens = sys.argv[1] or None, int(sys.argv[2]), int(sys.argv[3])
options = {"otlp_traces_endpoint": endpoint} if endpoint else {}
engine = Engine(EngineConfig(model="tiny", max_total_tokens=8192, swa_full_tokens_ratio=0.5, **options),
                progress=False)
prompts = [[2, *range(10 + i, 40 + i)] for i in range(requests)]
params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
engine.generate(prompts, params)  # warm-up
for line in sys.stdin:  # one round per line from the driver
    steps, start = 0, time.perf_counter()
    for p in prompts:
        engine.scheduler.add(Req(list(p), params))
    while engine.step():
        steps += 1
    print(json.dumps((time.perf_counter() - start) / steps), flush=True)
engine.close()
"""


class Sink(BaseHTTPRequestHandler):
    """A collector that accepts and drops every export."""

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def start(tree: Path, endpoint: str, args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.Popen([sys.executable, "-c", WORKER, endpoint, str(args.requests), str(args.new_tokens)],
                            cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--baseline", type=Path, default=None, help="another checkout, run with tracing off")
    args = p.parse_args()
    sink = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    settings = {"off": start(REPO, "", args),
                "on": start(REPO, f"http://127.0.0.1:{sink.server_address[1]}", args)}
    if args.baseline is not None:
        settings["baseline off"] = start(args.baseline.resolve(), "", args)
    times: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, proc in settings.items():
            proc.stdin.write("round\n")
            proc.stdin.flush()
            times[name].append(json.loads(proc.stdout.readline()))
    for proc in settings.values():
        proc.stdin.close()
        proc.wait(60)
    sink.shutdown()
    off = statistics.median(times["off"])
    print(f"{'setting':<14} {'median s/step':>14} {'vs off':>8}   (rounds: {args.rounds}, "
          f"{args.requests} requests x {args.new_tokens} tokens each)")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<14} {median:>14.6f} {median / off:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
