"""Is the first request after start-up as fast as the tenth? Time to first token of each, through the server.

Starts `swa-runtime serve` (its defaults, or the arguments after `--`), waits for /health, then streams `--requests`
different prompts of `--prompt-len` random token ids one after another and prints each one's TTFT and the first
over the last. A server that builds kernels or operator shapes on first use shows it here: the start-up warm-up
is meant to leave nothing for the first request to pay.

    python benchmarks/first_request.py [--requests 10] [--prompt-len 600] [--port 8095] [-- --dtype float32 ...]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time

import httpx


def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(f"{base}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server was not healthy within {timeout_s:.0f} s")


def ttft_ms(base: str, model: str, prompt: list[int]) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return (time.perf_counter() - start) * 1e3
    raise RuntimeError("the stream ended without a token")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--prompt-len", type=int, default=600)
    parser.add_argument("--port", type=int, default=8095)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("serve_args", nargs="*", help="arguments for `swa-runtime serve` (after --)")
    args = parser.parse_args()
    if args.requests < 2 or args.prompt_len < 2:
        parser.error("--requests and --prompt-len must be at least 2")
    base = f"http://127.0.0.1:{args.port}"
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", "--port", str(args.port), *args.serve_args],
                            stderr=subprocess.DEVNULL)
    try:
        wait_healthy(base, proc)
        model = httpx.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"]
        rng = random.Random(args.seed)
        times = []
        for _ in range(args.requests):  # different prompts: no prefix cache hit between them
            prompt = [2] + [rng.randrange(1000, 200000) for _ in range(args.prompt_len - 1)]
            times.append(ttft_ms(base, model, prompt))
        print("TTFT ms: " + ", ".join(f"{t:.0f}" for t in times))
        print(f"first / last: {times[0] / times[-1]:.2f}x")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
