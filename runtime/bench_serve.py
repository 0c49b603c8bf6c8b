"""`swa-runtime bench --serve`: throughput and latency through the OpenAI API, side by side in one run.

Starts `swa-runtime serve` (with the engine options given) as a subprocess on loopback and sends the same
synthetic prompts through `POST /v1/completions` (streaming, greedy, EOS ignored) at each concurrency, and
after it at each level to every OpenAI-compatible server given with `--peer URL` (repeatable; each answers a
warm-up request first); then runs transformers `generate` on the same prompts as static batches in float32
and bfloat16. With `--rounds N` every server runs each level N times, taking turns, and each ratio against a
peer comes with the range of the rounds' own: one round's ratio moves with the machine's pace. At concurrency
1 the server alternates request by request with the engine run in this process (what the server adds).
While one stream runs alone, another client sends a body of `--stall-body-mb` MB: the stream's longest
inter-token gap over its median says whether the front end stalls the engine. Nothing is asserted on time.

`--workload copy` sends code-editing requests whose answers copy the prompt instead of random ids
(`runtime/bench_workloads.py`). With speculation on, each row of the engine's gets the acceptance counted
meanwhile: the change of the server's `/metrics` counters (the offline engine's own) over the level.
`--compare-speculation` runs two servers instead, speculation off and on, taking turns on the same prompts,
and prints them side by side with the ratio of their tok/s and the `on` server's acceptance.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

from runtime.spec_counts import SpecCounts

HEADERS = {"Content-Type": "application/json"}
WARMUP_TOKENS = 4


@dataclass
class Wave:
    """One concurrency level against one server."""

    system: str
    concurrency: int
    seconds: float = 0.0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    spec: dict | None = None  # speculation's acceptance over the wave (`SpecCounts.as_dict`), where it ran
    rounds: list[float] = field(default_factory=list)  # tok/s of each round the wave ran in (`--rounds`)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def add(self, other: Wave) -> None:
        """Count `other` (requests to the same system, run apart) in this wave."""
        self.seconds += other.seconds
        self.tokens += other.tokens
        self.ttft += other.ttft
        self.itl += other.itl


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(engine_args: list[str], timeout_s: float = 900.0) -> tuple[subprocess.Popen, str]:
    return start_servers([engine_args], timeout_s)[0]


def start_servers(engine_args: list[list[str]], timeout_s: float = 900.0) -> list[tuple[subprocess.Popen, str]]:
    """`swa-runtime serve` with each of `engine_args`, all loading at once; back when every one is healthy."""
    servers = []
    for argv in engine_args:
        port = _free_port()
        cmd = [sys.executable, "-m", "runtime", "serve", "--port", str(port), *argv]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        servers.append((proc, f"http://127.0.0.1:{port}"))
    deadline = time.monotonic() + timeout_s
    try:
        for proc, url in servers:
            while not _healthy(proc, url):
                if time.monotonic() > deadline:
                    raise RuntimeError("swa-runtime serve did not become healthy in time")
                time.sleep(0.5)
    except BaseException:
        for proc, _ in servers:
            proc.kill()
        raise
    return servers


def _healthy(proc: subprocess.Popen, url: str) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"swa-runtime serve exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


async def _stream(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], gen_len: int,
                  wave: Wave, gaps: list[float] | None = None) -> None:
    """One streamed request. Times each chunk that carries text (a chunk usually carries one token; a server
    may hold back a partial character or merge tokens), and counts the tokens the server says it generated
    (`usage` of the last chunk; `gen_len` where a server sends none)."""
    body = {"model": model, "prompt": prompt, "max_tokens": gen_len, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start = last = time.perf_counter()
    first, generated = True, gen_len
    async with client.stream("POST", url + "/v1/completions", headers=HEADERS, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            generated = (chunk.get("usage") or {}).get("completion_tokens", generated)
            if _closing_chunk(chunk):
                continue
            now = time.perf_counter()
            (wave.ttft if first else wave.itl).append(now - (start if first else last))
            if gaps is not None and not first:
                gaps.append(now - last)
            first, last = False, now
    wave.tokens += generated


def _closing_chunk(chunk: dict) -> bool:
    """A chunk without a token: one that only carries the finish reason (some servers send it after the last
    token), or only the usage (`choices` empty, as with OpenAI's `stream_options.include_usage`)."""
    return all(c.get("finish_reason") and not c.get("text") for c in chunk.get("choices") or [])


async def _wave(url: str, model: str, prompts: list[list[int]], concurrency: int, gen_len: int, system: str) -> Wave:
    wave = Wave(system, concurrency)
    sem = asyncio.Semaphore(concurrency)
    # A new connection per request: some servers (llama.cpp's) drop a kept-alive connection between requests.
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        async def one(prompt):
            async with sem:
                await _stream(client, url, model, prompt, gen_len, wave)

        start = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        wave.seconds = time.perf_counter() - start
    return wave


async def _stall(url: str, model: str, prompt: list[int], gen_len: int, body_mb: float) -> dict:
    """One stream alone; halfway through its first tokens, another client posts a `body_mb` MB body."""
    wave, gaps = Wave("stall", 1), []
    big = json.dumps({"model": model, "prompt": "x" * int(body_mb * 2**20), "max_tokens": 1}).encode()
    async with httpx.AsyncClient(timeout=None) as client:
        async def intruder():
            while len(gaps) < 3:
                await asyncio.sleep(0.01)
            r = await client.post(url + "/v1/completions", headers=HEADERS, content=big)
            return r.status_code

        stream = asyncio.create_task(_stream(client, url, model, prompt, gen_len, wave, gaps))
        status = await intruder()
        await stream
    return {"body_mb": body_mb, "body_status": status, "median_gap_ms": statistics.median(gaps) * 1e3,
            "max_gap_ms": max(gaps) * 1e3, "max_over_median": max(gaps) / statistics.median(gaps)}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e3


def _offline_engine(cfg, warmup: list[int]):
    """The engine in this process (idle while the server is measured), warmed up like the server."""
    from runtime.core import SamplingParams
    from runtime.engine import Engine

    engine = Engine(cfg, progress=False)
    engine.generate([warmup], SamplingParams(max_new_tokens=WARMUP_TOKENS, ignore_eos=True))
    return engine


def _paired_c1(url: str, model: str, engine, prompts: list[list[int]], gen_len: int) -> tuple[Wave, Wave]:
    """c=1 through the server and through the offline engine, request by request alternately, so that load
    drifting over the minutes of a run (this machine's noise) falls on both sides alike."""
    from runtime.core import SamplingParams

    served, offline = Wave("swa-runtime serve", 1), Wave("offline engine", 1)
    for p in prompts:
        served.add(asyncio.run(_wave(url, model, [p], 1, gen_len, served.system)))
        start = time.perf_counter()
        engine.generate([p], SamplingParams(max_new_tokens=gen_len, ignore_eos=True))
        offline.seconds += time.perf_counter() - start
        offline.tokens += gen_len
    return served, offline


def spec_counts(url: str) -> SpecCounts:
    """The server's speculation counters now (`/metrics`)."""
    r = httpx.get(url + "/metrics", timeout=60)
    r.raise_for_status()
    return SpecCounts.from_metrics(r.text)


def _transformers(cfg, dtype: str, prompts: list[list[int]], batch: int, gen_len: int) -> Wave:
    from runtime.bench import load_transformers, run_transformers

    model = load_transformers(cfg.with_(dtype=dtype))
    run_transformers(model, [prompts[0][:16]], 2)  # warm-up
    wave = Wave(f"transformers {dtype}", batch)
    for i in range(0, len(prompts), batch):
        run = run_transformers(model, prompts[i:i + batch], gen_len)
        wave.seconds += run.seconds
        wave.tokens += len(prompts[i:i + batch]) * gen_len
    return wave


def _workload(args, cfg, levels: list[int], rounds: int = 1):
    """max(c, --min-requests) prompts a level and round, the rounds' one after the other (`round_prompts`): each
    round its own, as a prompt sent again would be answered from a prefix cache."""
    from runtime.bench_workloads import build_workload

    return build_workload(args.workload, {c: rounds * max(c, args.min_requests) for c in levels}, args.prompt_len,
                          cfg)


def round_prompts(prompts: list[list[int]], rounds: int, r: int) -> list[list[int]]:
    """Round r's share of a level's prompts (`_workload` with `rounds`)."""
    n = len(prompts) // rounds
    return prompts[r * n:(r + 1) * n]


def peers(args) -> list[tuple[str, str]]:
    """(URL, model) of each `--peer`, paired with the `--peer-model`s in order ("default" past the last)."""
    urls, models = args.peer or [], args.peer_model or []
    if len(models) > len(urls):
        raise ValueError(f"{len(models)} --peer-model for {len(urls)} --peer: give one --peer URL per model")
    return [(url, models[i] if i < len(models) else "default") for i, url in enumerate(urls)]


def peer_label(model: str) -> str:
    return f"peer {model}"


def run_bench_serve(args, cfg, engine_args: list[str]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    levels = [int(x) for x in args.concurrency.split(",")]
    others = peers(args)
    workload = _workload(args, cfg, levels, args.rounds)
    prompts, warmup = workload.prompts, workload.warmup
    speculating = cfg.speculative_algorithm != "none"
    waves: list[Wave] = []
    failures: list[str] = []
    offline = None
    engine = _offline_engine(cfg, warmup) if 1 in levels else None
    proc, url = start_server(engine_args)

    def peer_wave(peer_url: str, model: str, batch: list[list[int]], c: int, gen_len: int, system: str) -> Wave | None:
        """A peer's wave; its failure costs its row, not the run."""
        try:
            return asyncio.run(_wave(peer_url, model, batch, c, gen_len, system))
        except (httpx.HTTPError, RuntimeError) as exc:
            failures.append(f"{system} at c={c} failed: {type(exc).__name__}: {exc}")
            return None

    try:
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        asyncio.run(_wave(url, name, [warmup], 1, WARMUP_TOKENS, "warm-up"))
        for peer_url, model in others:  # each server answers one request before it is timed
            peer_wave(peer_url, model, [warmup], 1, WARMUP_TOKENS, "warm-up")
        # Level by level, every server in turn: the machine's pace drifts over minutes (its memory bandwidth
        # by up to 1.6x on a shared 2-core EPYC), so each level's rows are measured minutes apart at most; with
        # --rounds, each server runs the level again in every round, the order turned by one each round.
        for c in levels:
            before = spec_counts(url) if speculating else None
            offline_before = SpecCounts.from_stats(engine.stats.spec) if speculating and c == 1 else None

            def ours(r: int) -> Wave:
                nonlocal offline
                batch = round_prompts(prompts[c], args.rounds, r)
                if c != 1:
                    return asyncio.run(_wave(url, name, batch, c, args.gen_len, "swa-runtime serve"))
                served_c1, offline_c1 = _paired_c1(url, name, engine, batch, args.gen_len)
                offline = _merge(offline, offline_c1)
                return served_c1

            sides = [ours, *(lambda r, u=u, m=m: peer_wave(u, m, round_prompts(prompts[c], args.rounds, r), c,
                                                           args.gen_len, peer_label(m)) for u, m in others)]
            level = take_turns(sides, args.rounds)
            if before is not None and "swa-runtime serve" in level:
                level["swa-runtime serve"].spec = (spec_counts(url) - before).as_dict()
            if offline_before is not None:
                offline.spec = (SpecCounts.from_stats(engine.stats.spec) - offline_before).as_dict()
            waves += [level[s] for s in ("swa-runtime serve", *(peer_label(m) for _, m in others)) if s in level]
        stall = asyncio.run(_stall(url, name, prompts[1][0] if 1 in prompts else warmup, max(args.gen_len, 32),
                                   args.stall_body_mb))
    finally:
        stop_server(proc)
    del engine
    if offline is not None:
        waves.append(offline)
    if not args.skip_transformers and args.workload == "standard":  # static batches want equal lengths
        for dtype in ("float32", "bfloat16"):
            for c in levels:
                if c <= args.transformers_max_batch:
                    waves.append(_transformers(cfg, dtype, round_prompts(prompts[c], args.rounds, 0), c,
                                               args.gen_len))
    print("\n".join([format_serve_report(waves, stall, args, workload.describe()), *failures]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": _workload_json(workload), "waves": [_wave_json(w) for w in waves],
                       "stall": stall}, f, indent=1)
    return 0


def take_turns(sides: list[Callable[[int], Wave | None]], rounds: int) -> dict[str, Wave]:
    """Each side's waves over `rounds` rounds (a side is called with the round's number), by system, each
    counted into one: in round r the sides run from the r-th on (wrapping), so that none always runs first or
    right after another. A side that returns None (failed) counts nothing that round."""
    level: dict[str, Wave] = {}
    for r in range(rounds):
        first = r % len(sides)
        for side in sides[first:] + sides[:first]:
            wave = side(r)
            if wave is not None:
                level[wave.system] = _merge(level.get(wave.system), wave)
    return level


def _merge(total: Wave | None, wave: Wave) -> Wave:
    """`wave` counted into `total` (None: the first), its tok/s kept as one more round."""
    if total is None:
        total = Wave(wave.system, wave.concurrency)
    total.add(wave)
    total.rounds.append(wave.tok_s)
    return total


def _wave_json(w: Wave) -> dict:
    return vars(w) | {"tok_s": w.tok_s}


def _workload_json(workload) -> dict:
    return {"name": workload.name, "description": workload.describe(), "sources": workload.sources,
            "prompt_tokens": {c: [len(p) for p in ps] for c, ps in workload.prompts.items()}}


def _ms(values: list[float], q: float, width: int, decimals: int) -> str:
    """A percentile in ms for the report, right-aligned; "-" where nothing was timed (offline runs)."""
    return f"{_pct(values, q):>{width}.{decimals}f}" if values else f"{'-':>{width}}"


def _acceptance(spec: dict | None) -> str:
    """The acceptance columns: accepted/drafted draft tokens and mean tokens per verify ("-" where none)."""
    if not spec or not spec["drafted"]:
        return f"{'-':>8}{'-':>9}"
    return f"{spec['rate']:>8.1%}{spec['per_verify']:>9.2f}"


ACCEPTANCE_HEADER = f"{'accept':>8}{'tok/vfy':>9}"
ACCEPTANCE_NOTE = ("accept: draft tokens accepted / proposed; tok/vfy: tokens a request got per verify forward "
                   "(accepted + 1); both counted by the engine between the start and the end of the level")


def _peer_ratio(ours: Wave, peer: Wave) -> str:
    """Ours over the peer at one level: all rounds' tokens over all their seconds, and where both ran in more than
    one round, the range of the rounds' own ratios (round i against round i)."""
    text = f"{ours.tok_s / peer.tok_s:.2f}x at c={peer.concurrency}"
    pairs = [a / b for a, b in zip(ours.rounds, peer.rounds) if b > 0]
    if len(pairs) > 1 and len(ours.rounds) == len(peer.rounds):  # a failed round leaves nothing to pair
        text += f" (rounds {min(pairs):.2f}-{max(pairs):.2f})"
    return text


def format_serve_report(waves: list[Wave], stall: dict, args, workload: str) -> str:
    speculating = any(w.spec is not None for w in waves)
    lines = [f"swa-runtime bench --serve: {workload}; {args.gen_len} new tokens, greedy, EOS ignored; requests "
             "per level = max(concurrency, --min-requests)", "",
             f"{'system':<26}{'c':>4}{'tok/s':>9}{'vs best hf':>11}{ACCEPTANCE_HEADER if speculating else ''}"
             f"{'TTFT p50':>10}{'p90':>8}{'ITL p50':>9}{'p90':>7}{'p99':>7}   (ms)"]
    for w in waves:
        hf = [x.tok_s for x in waves if x.system.startswith("transformers") and x.concurrency == w.concurrency]
        ratio = f"{w.tok_s / max(hf):.2f}" if hf else "-"
        lines.append(f"{w.system:<26}{w.concurrency:>4}{w.tok_s:>9.1f}{ratio:>11}"
                     f"{_acceptance(w.spec) if speculating else ''}{_ms(w.ttft, .5, 10, 0)}"
                     f"{_ms(w.ttft, .9, 8, 0)}{_ms(w.itl, .5, 9, 1)}{_ms(w.itl, .9, 7, 1)}{_ms(w.itl, .99, 7, 1)}")
    if speculating:
        lines.append(ACCEPTANCE_NOTE)
    served = {w.concurrency: w for w in waves if w.system == "swa-runtime serve"}
    for peer in dict.fromkeys(w.system for w in waves if w.system.startswith("peer ")):
        ratios = [_peer_ratio(served[w.concurrency], w) for w in waves
                  if w.system == peer and w.concurrency in served and w.tok_s > 0]
        lines.append(f"swa-runtime serve vs {peer}: {', '.join(ratios)} (tok/s)")
    offline = next((w for w in waves if w.system == "offline engine"), None)
    if offline and 1 in served:
        lines.append(f"\nthe server at c=1 vs the offline engine: {served[1].tok_s / offline.tok_s:.3f} "
                     f"({(1 - served[1].tok_s / offline.tok_s) * 100:+.1f}% lost)")
    if 8 in served and 32 in served:
        lines.append(f"c=32 vs c=8 through the server: {served[32].tok_s / served[8].tok_s:.2f}x")
    lines.append(f"a stream's inter-token gaps while another client sent {stall['body_mb']:g} MB (answered "
                 f"{stall['body_status']}): median {stall['median_gap_ms']:.1f} ms, longest "
                 f"{stall['max_gap_ms']:.1f} ms ({stall['max_over_median']:.2f}x the median)")
    return "\n".join(lines)


# ---- speculation on vs off -------------------------------------------------------------------------------


def speculation_sides(args) -> dict[str, list[str]]:
    """The engine options of the two servers `--compare-speculation` starts: the ones given with speculation
    off, and with it on (the algorithm given, ngram where none was)."""
    from argparse import Namespace

    from runtime.options import engine_argv

    return {side: engine_argv(Namespace(**vars(args) | {"speculative_algorithm": value}))
            for side, value in (("off", "none"), ("on", _on_algorithm(args)))}


def _on_algorithm(args) -> str:
    return args.speculative_algorithm if args.speculative_algorithm != "none" else "ngram"


def run_compare_speculation(args, cfg) -> int:
    """Both servers up for the whole run, taking turns on the same prompts at each level: request by request
    at c=1, wave by wave above, the order alternating (off/on, then on/off), so that load drifting over the
    run falls on both sides alike; the acceptance is the delta of the `on` server's counters per level."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.peer:
        raise ValueError("--compare-speculation runs the two servers only; --peer does not apply")
    if args.rounds > 1:
        raise ValueError("--compare-speculation already takes turns request by request or wave by wave; "
                         "--rounds does not apply")
    levels = [int(x) for x in args.concurrency.split(",")]
    workload = _workload(args, cfg, levels)
    sides = speculation_sides(args)
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    rows: list[dict[str, Wave]] = []
    try:
        servers = dict(zip(sides, start_servers(list(sides.values()))))
        urls = {side: url for side, (_, url) in servers.items()}
        name = httpx.get(urls["off"] + "/v1/models").json()["data"][0]["id"]
        for url in urls.values():
            asyncio.run(_wave(url, name, [workload.warmup], 1, WARMUP_TOKENS, "warm-up"))
        turn = 0
        for c in levels:
            prompts = workload.prompts[c]
            waves = {side: Wave(f"speculation {side}", c) for side in sides}
            before = {side: spec_counts(url) for side, url in urls.items()}
            for unit in ([[p] for p in prompts] if c == 1 else [prompts]):
                for side in (("off", "on"), ("on", "off"))[turn % 2]:
                    waves[side].add(asyncio.run(_wave(urls[side], name, unit, c, args.gen_len, waves[side].system)))
                turn += 1
            for side, url in urls.items():
                waves[side].spec = (spec_counts(url) - before[side]).as_dict()
            rows.append(waves)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    print(format_compare_report(rows, args, workload.describe(), sides["on"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": _workload_json(workload), "engine_args": sides,
                       "levels": [{"concurrency": r["on"].concurrency, "on_over_off": _ratio(r),
                                   **{side: _wave_json(w) for side, w in r.items()}} for r in rows]}, f, indent=1)
    return 0


def _ratio(row: dict[str, Wave]) -> float:
    return row["on"].tok_s / row["off"].tok_s if row["off"].tok_s else float("nan")


def format_compare_report(rows: list[dict[str, Wave]], args, workload: str, on_args: list[str]) -> str:
    lookup = (f", prompt lookup of the last {args.prompt_lookup_max}..{args.prompt_lookup_min} tokens"
              if _on_algorithm(args) == "ngram" else "")
    lines = [f"swa-runtime bench --serve --compare-speculation: {workload}; {args.gen_len} new tokens, greedy, "
             "EOS ignored; requests per level = max(concurrency, --min-requests)",
             f"speculation on: {_on_algorithm(args)}, at most {args.num_speculative_tokens} draft tokens"
             f"{lookup} (server options: {' '.join(on_args)}); off: the same without speculation. Both servers "
             "run throughout, taking turns (request by request at c=1, wave by wave above)", "",
             f"{'c':>4}{'off tok/s':>11}{'on tok/s':>10}{'on/off':>8}{'drafted':>9}{'accepted':>10}"
             f"{ACCEPTANCE_HEADER}{'ITL p50 off':>13}{'on':>7}{'TTFT p50 off':>14}{'on':>7}   (ms)"]
    for r in rows:
        off, on = r["off"], r["on"]
        lines.append(f"{on.concurrency:>4}{off.tok_s:>11.1f}{on.tok_s:>10.1f}{_ratio(r):>8.2f}"
                     f"{on.spec['drafted']:>9.0f}{on.spec['accepted']:>10.0f}{_acceptance(on.spec)}"
                     f"{_ms(off.itl, .5, 13, 1)}{_ms(on.itl, .5, 7, 1)}"
                     f"{_ms(off.ttft, .5, 14, 0)}{_ms(on.ttft, .5, 7, 0)}")
    lines.append(ACCEPTANCE_NOTE)
    return "\n".join(lines)
