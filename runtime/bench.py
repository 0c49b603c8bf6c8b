"""`swa-runtime bench`: this runtime next to transformers on the same weights, measured in one run.

Three measurements, printed side by side; nothing is asserted on time:

1. Throughput: the same synthetic prompts through `Engine.generate` and through transformers' `generate`
   (both greedy, EOS ignored, the same number of new tokens), at each batch size; tokens/s with prefill
   included and decode-only, their ratio, and how many greedy tokens agree.
2. KV memory: bytes of K/V held per cached token at the end of prefill (read from the allocators at that
   moment), against a layout where every layer holds every token.
3. Telemetry overhead: decode-step time with telemetry on and off, two engines stepping the same requests in
   lockstep (on/off, then off/on, ...), compared step pair by step pair, with a 95% interval of the median.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable
from unittest import mock

import torch
from tqdm import tqdm

from runtime.config import EngineConfig
from runtime.core import Req, SamplingParams
from runtime.engine import Engine
from runtime.memory_bound import decode_kv_bytes, decode_weight_bytes, read_bandwidth, read_buffer
from runtime.models.loader import load_model, random_state_dict
from runtime.models.registry import resolve_model
from runtime.models.tokenizer import load_tokenizer
from runtime.spec_counts import SpecCounts

FIRST_REGULAR_ID = 4  # ids 0..3 are pad, eos, bos, unk in Gemma's vocabulary and in the tiny byte tokenizer
WARMUP_PROMPT_LEN = 16
HF_ATTENTION = "sdpa"  # transformers' default on CPU: what a user of `generate` gets


@dataclass
class RunResult:
    outputs: list[list[int]]
    seconds: float  # whole generate call, prefill included
    decode_seconds: float | None  # from "every request has its first token" to the end
    kv_used: dict | None = None  # ours only: allocator usage at the end of prefill
    recomputed_tokens: int = 0  # ours only: prefill tokens beyond the prompts (a retracted request redone)
    speculation: dict | None = None  # ours only, speculating: the acceptance over the run (`SpecCounts.as_dict`)


# ---- prompts -----------------------------------------------------------------------------------------


def synthetic_prompts(batch: int, length: int, vocab_size: int, bos: int, seed: int) -> list[list[int]]:
    """`batch` different prompts of `length` ids: BOS, then ids drawn uniformly from the regular vocabulary."""
    gen = torch.Generator().manual_seed(seed * 1000 + batch)
    body = torch.randint(FIRST_REGULAR_ID, vocab_size, (batch, length - 1), generator=gen)
    return [[bos] + row for row in body.tolist()]


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ---- this runtime ----------------------------------------------------------------------------------------


class EngineProbe:
    """Watches an Engine through its step observer, without changing what it computes: times decode
    forwards, counts prefill tokens, reports tokens to a progress callback, and records the clock and the
    pools' usage after the last prefill step (in `generate` every request is admitted at once, and the
    scheduler decodes only when no prefill is pending, so that is the end of prefill)."""

    def __init__(self):
        self.engine: Engine | None = None
        self.on_tokens: Callable[[int], object] | None = None
        self.reset()

    def reset(self) -> None:
        self.decode_steps: list[float] = []
        self.prefill_tokens = 0
        self.prefill_end: float | None = None
        self.kv_used: dict | None = None

    def after_step(self, batch, forward_seconds: float) -> None:
        if batch.is_decode or batch.is_verify:  # a verify forward (speculation) is a decode step with drafts
            self.decode_steps.append(forward_seconds)
        else:
            self.prefill_tokens += batch.num_tokens
            self.prefill_end = time.perf_counter()
            self.kv_used = {f"{pool}_{state}": n for (pool, state), n in self.engine.kv_tokens().items()}
        if self.on_tokens is not None:
            self.on_tokens(batch.num_tokens)


def probed_engine(cfg: EngineConfig, model, tokenizer) -> EngineProbe:
    """An engine built with a probe as its step observer."""
    probe = EngineProbe()
    probe.engine = Engine(cfg, model=model, tokenizer=tokenizer, observer=probe)
    return probe


def run_ours(probe: EngineProbe, prompts: list[list[int]], gen_len: int, bar: tqdm | None = None) -> RunResult:
    probe.reset()
    probe.on_tokens = bar.update if bar is not None else None
    spec_before = SpecCounts.from_stats(probe.engine.stats.spec)
    start = time.perf_counter()
    outputs = probe.engine.generate(prompts, SamplingParams(max_new_tokens=gen_len, ignore_eos=True))
    end = time.perf_counter()
    probe.on_tokens = None
    decode_seconds = None if probe.prefill_end is None else end - probe.prefill_end
    speculation = None
    if probe.engine.cfg.speculative_algorithm != "none":
        speculation = (SpecCounts.from_stats(probe.engine.stats.spec) - spec_before).as_dict()
    return RunResult(outputs, end - start, decode_seconds, probe.kv_used,
                     probe.prefill_tokens - sum(len(p) for p in prompts), speculation)


# ---- transformers ----------------------------------------------------------------------------------------


def load_transformers(cfg: EngineConfig):
    """transformers' Gemma 3 on the weights `cfg.model` names: the same GGUF file or directory, or for `tiny`
    a model built from our config with the same seeded random weights. EOS stopping is switched off."""
    import transformers
    import transformers.modeling_utils as modeling_utils
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    transformers.logging.set_verbosity_error()
    cfg = cfg.concrete()
    dtype, source = getattr(torch, cfg.dtype), resolve_model(cfg.model)
    if source.kind == "tiny":
        hf_config = Gemma3TextConfig(**source.config.to_hf_dict(), attn_implementation=HF_ATTENTION)
        model = Gemma3ForCausalLM._from_config(hf_config, dtype=dtype)
        state = random_state_dict(source.config, seed=source.seed, dtype=dtype)
        result = model.load_state_dict(state, strict=False)
        if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
            raise RuntimeError(f"tiny weights do not fit transformers' model: {result}")
    elif source.kind == "gguf":
        # NOTE: `from_pretrained` refuses GGUF files unless `accelerate` is installed, which gemma3's GGUF
        # path (full dequantisation) does not use; the check is lifted for this call only.
        with mock.patch.object(modeling_utils, "is_accelerate_available", lambda: True):
            model = AutoModelForCausalLM.from_pretrained(
                str(source.path.parent), gguf_file=source.path.name, dtype=dtype,
                attn_implementation=HF_ATTENTION, local_files_only=True)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype,
                                                     attn_implementation=HF_ATTENTION, local_files_only=True)
    # NOTE: with no EOS, generate runs exactly max_new_tokens steps and never masks a logit, as ignore_eos
    # does here; `min_new_tokens` would instead mask EOS and could change greedy choices.
    model.generation_config.eos_token_id = None
    return model.to(cfg.device).eval().requires_grad_(False)


class TokenClock:
    """A `generate` streamer that timestamps each put: first the prompt, then one token per step."""

    def __init__(self, batch: int, prompt_len: int, bar: tqdm | None = None):
        self.times: list[float] = []
        self.batch, self.prompt_len, self.bar = batch, prompt_len, bar

    def put(self, value) -> None:
        self.times.append(time.perf_counter())
        if self.bar is not None and len(self.times) > 1:
            self.bar.update(self.batch * (self.prompt_len if len(self.times) == 2 else 1))

    def end(self) -> None:
        pass


def run_transformers(model, prompts: list[list[int]], gen_len: int, bar: tqdm | None = None) -> RunResult:
    from transformers import GenerationConfig

    ids = torch.tensor(prompts, device=model.device)  # (B, T): equal lengths, so no padding
    clock = TokenClock(len(prompts), ids.shape[1], bar)
    config = GenerationConfig(do_sample=False, max_new_tokens=gen_len)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                             streamer=clock)
    _sync(model.device)
    end = time.perf_counter()
    new = out[:, ids.shape[1]:]
    if new.shape[1] != gen_len:
        raise RuntimeError(f"transformers generated {new.shape[1]} tokens, expected {gen_len}")
    return RunResult(new.tolist(), end - start, end - clock.times[1] if len(clock.times) > 1 else None)


# ---- the three measurements ------------------------------------------------------------------------------


def throughput_row(batch: int, gen_len: int, ours: RunResult, theirs: RunResult | None) -> dict:
    tokens, decode_tokens = batch * gen_len, batch * (gen_len - 1)

    def rates(run: RunResult) -> tuple[float, float | None]:
        decode = decode_tokens / run.decode_seconds if decode_tokens and run.decode_seconds else None
        return tokens / run.seconds, decode

    row = {"batch": batch, "generated_tokens": tokens, "ours_recomputed_tokens": ours.recomputed_tokens,
           "ours_speculation": ours.speculation}
    row["ours_tok_s"], row["ours_decode_tok_s"] = rates(ours)
    row["hf_tok_s"] = row["hf_decode_tok_s"] = row["ratio"] = row["decode_ratio"] = None
    row["equal_token_fraction"] = row["identical_sequences"] = None
    if theirs is not None:
        row["hf_tok_s"], row["hf_decode_tok_s"] = rates(theirs)
        row["ratio"] = row["ours_tok_s"] / row["hf_tok_s"]
        if row["ours_decode_tok_s"] and row["hf_decode_tok_s"]:
            row["decode_ratio"] = row["ours_decode_tok_s"] / row["hf_decode_tok_s"]
        pairs = [(a, b) for o, t in zip(ours.outputs, theirs.outputs) for a, b in zip(o, t)]
        row["equal_token_fraction"] = sum(a == b for a, b in pairs) / len(pairs)
        row["identical_sequences"] = sum(o == t for o, t in zip(ours.outputs, theirs.outputs))
    return row


def kv_row(engine: Engine, batch: int, prompts: list[list[int]], used: dict | None) -> dict | None:
    """Measured bytes per cached token at the end of prefill vs every layer holding every token
    (None when there was no decode step, i.e. --gen-len 1: requests end, and free their slots, at prefill)."""
    if used is None:
        return None
    full_bytes, swa_bytes = engine.pool.bytes_per_token()
    tokens = sum(len(p) for p in prompts)
    mc = engine.model_config
    element = torch.empty((), dtype=getattr(torch, engine.cfg.dtype)).element_size()
    full_only = mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * element
    ours = (used["full_used"] * full_bytes + used["swa_used"] * swa_bytes) / tokens
    return {"batch": batch, "tokens": tokens, "full_slots": used["full_used"], "swa_slots": used["swa_used"],
            "ours_bytes_per_token": ours, "full_attention_bytes_per_token": full_only, "ratio": ours / full_only}


def telemetry_overhead(probes: dict[str, EngineProbe], prompts: list[list[int]], gen_len: int, rounds: int,
                       progress: bool, after_round: Callable[[], float] | None = None) -> dict:
    """Decode-forward time with telemetry on and off. Both engines serve the same requests in lockstep, one
    step each in turn (on/off, then off/on, ...), so their i-th decode steps run the same batch moments
    apart, under the same load from other processes; whole runs, seconds apart, drift by +-15% on a shared
    two-core machine. The overhead is the median over step pairs of on/off. `after_round`: a measurement
    taken after each round (the read bandwidth), listed with each round's median telemetry-on step."""
    steps: dict[str, list[float]] = {"on": [], "off": []}
    ratios: list[float] = []
    per_round: list[tuple[float, float | None]] = []  # (median step on, after_round's value)
    params = SamplingParams(max_new_tokens=gen_len, ignore_eos=True)
    with tqdm(total=rounds, desc="telemetry on/off", unit="round", disable=not progress, leave=False) as bar:
        for r in range(rounds):
            reqs = {label: [Req(list(p), params) for p in prompts] for label in probes}
            for label, probe in probes.items():
                probe.reset()
                for req in reqs[label]:
                    probe.engine.scheduler.add(req)
            turn = 0
            while not all(req.done for side in reqs.values() for req in side):
                for label in (("on", "off"), ("off", "on"))[(r + turn) % 2]:
                    if not all(req.done for req in reqs[label]) and not probes[label].engine.step():
                        raise RuntimeError("the scheduler made no progress with requests pending")
                turn += 1
            on, off = probes["on"].decode_steps, probes["off"].decode_steps
            if len(on) != len(off):
                raise RuntimeError(f"the two engines ran {len(on)} and {len(off)} decode steps for the same requests")
            steps["on"] += on
            steps["off"] += off
            ratios += [a / b for a, b in zip(on, off)]
            per_round.append((statistics.median(on), after_round() if after_round is not None else None))
            bar.update()
    low, high = median_interval(ratios)
    return {"batch": len(prompts), "rounds": rounds, "steps_per_side": len(steps["on"]),
            "median_step_ms_on": statistics.median(steps["on"]) * 1e3,
            "median_step_ms_off": statistics.median(steps["off"]) * 1e3,
            "pair_ratios": ratios, "per_round": per_round, "overhead_pct": (statistics.median(ratios) - 1) * 100,
            "overhead_pct_ci95": ((low - 1) * 100, (high - 1) * 100)}


def memory_limit(model, overhead: dict, kv_bytes: float = 0.0) -> dict:
    """A decode step next to its memory-bound floor: the bytes it reads (its weights, and `kv_bytes`: the keys and
    values, the mean over the steps) over the machine's read bandwidth (runtime/memory_bound.py), probed after
    each round of `overhead` (`telemetry_overhead` with the probe as `after_round`): each round's median
    telemetry-on step over the floor at its own bandwidth, since a shared machine's bandwidth moves between
    rounds. The ratio is the median over rounds."""
    weights = decode_weight_bytes(model, overhead["batch"])
    total = weights + kv_bytes
    rounds = [(step, total / bandwidth) for step, bandwidth in overhead["per_round"]]
    ratios = [step / floor for step, floor in rounds]
    bandwidths = [bandwidth for _, bandwidth in overhead["per_round"]]
    bandwidth = statistics.median(bandwidths)
    return {"batch": overhead["batch"], "weight_bytes": weights, "kv_bytes": kv_bytes, "read_bytes": total,
            "read_bandwidth": bandwidth, "read_bandwidth_range": (min(bandwidths), max(bandwidths)),
            "floor_ms": total / bandwidth * 1e3,
            "step_ms": overhead["median_step_ms_on"], "round_ratios": ratios,
            "step_over_floor": statistics.median(ratios)}


def median_interval(values: list[float]) -> tuple[float, float]:
    """A distribution-free 95% confidence interval of the median: the order statistics n/2 -+ 0.98 sqrt(n)
    (the normal approximation of the binomial count of values below the median)."""
    s, n = sorted(values), len(values)
    k = max(0, int(n / 2 - 0.98 * math.sqrt(n)))
    return s[k], s[n - 1 - k]


# ---- report ----------------------------------------------------------------------------------------------


def _num(value, fmt: str, width: int) -> str:
    return f"{'-' if value is None else format(value, fmt):>{width}}"


def format_report(report: dict) -> str:
    s = report["setup"]
    lines = [
        f"swa-runtime bench: model {s['model']} ({s['dtype']}, {s['device']}, {s['threads']} threads), attention "
        f"{s['attention_backend']}, loc-cache {s['loc_cache']}, graphs {'on' if s['graphs'] else 'off'}",
        f"prompts: {s['prompt_len']} synthetic token ids each (sliding window {s['window']}), {s['gen_len']} new "
        f"tokens, greedy, EOS ignored; oracle: {s['transformers'] or 'skipped'}",
        "",
        "Throughput (generated tokens / wall time; 'all' includes prefill, 'decode' counts tokens after the first)",
        f"{'batch':>5} {'ours all':>9} {'hf all':>9} {'ratio':>6} {'ours dec':>9} {'hf dec':>9} {'ratio':>6}"
        f" {'greedy tokens equal':>21}",
    ]
    recomputed = sum(r["ours_recomputed_tokens"] for r in report["throughput"])
    for r in report["throughput"]:
        equal = "-" if r["equal_token_fraction"] is None else (
            f"{r['equal_token_fraction']:.1%} ({r['identical_sequences']}/{r['batch']} seq)")
        lines.append(f"{r['batch']:>5} {_num(r['ours_tok_s'], '.1f', 9)} {_num(r['hf_tok_s'], '.1f', 9)}"
                     f" {_num(r['ratio'], '.2f', 6)} {_num(r['ours_decode_tok_s'], '.1f', 9)}"
                     f" {_num(r['hf_decode_tok_s'], '.1f', 9)} {_num(r['decode_ratio'], '.2f', 6)} {equal:>21}")
    for r in report["throughput"]:
        if r["ours_speculation"] is not None:
            lines.append(f"speculation ({s['speculation']}), batch {r['batch']}: "
                         f"{SpecCounts.from_dict(r['ours_speculation']).summary()}")
    if recomputed:
        lines.append(f"note: the scheduler retracted requests under pool pressure ({recomputed} prompt tokens "
                     "prefilled again); raise --max-total-tokens for a clean comparison")
    lines += ["", "KV memory at the end of prefill (bytes of K+V per cached token; full-attention layout: every "
              "layer holds every token)",
              f"{'batch':>5} {'tokens':>7} {'full slots':>10} {'swa slots':>9} {'ours B/tok':>10}"
              f" {'full-attn B/tok':>15} {'ratio':>6}"]
    for r in filter(None, report["kv"]):
        lines.append(f"{r['batch']:>5} {r['tokens']:>7} {r['full_slots']:>10} {r['swa_slots']:>9}"
                     f" {r['ours_bytes_per_token']:>10.0f} {r['full_attention_bytes_per_token']:>15}"
                     f" {r['ratio']:>6.3f}")
    if not any(report["kv"]):
        lines.append("    - (read before the first decode step: needs --gen-len >= 2)")
    o = report["telemetry_overhead"]
    lines += ["", f"Telemetry overhead (decode forward, batch {o['batch']}, {o['rounds']} rounds of two engines in "
              f"lockstep, {o['steps_per_side']} step pairs)",
              f"  median step, telemetry on : {o['median_step_ms_on']:.3f} ms",
              f"  median step, telemetry off: {o['median_step_ms_off']:.3f} ms",
              f"  overhead: {o['overhead_pct']:+.2f}% (median over step pairs of on/off; 95% interval "
              f"{o['overhead_pct_ci95'][0]:+.2f}% .. {o['overhead_pct_ci95'][1]:+.2f}%)"]
    m = report.get("memory_limit")
    if m is not None:
        low, high = m["read_bandwidth_range"]
        ratios = m["round_ratios"]
        lines += ["", f"Decode against the memory limit (batch {m['batch']}, the telemetry-on steps above)",
                  f"  bytes read per step: {m['read_bytes'] / 1e6:.1f} MB (weights {m['weight_bytes'] / 1e6:.1f}, keys "
                  f"and values {m['kv_bytes'] / 1e6:.1f}: the mean over the steps)",
                  f"  read bandwidth probed after each round: median {m['read_bandwidth'] / 1e9:.1f} GB/s "
                  f"({low / 1e9:.1f} .. {high / 1e9:.1f}; {s['threads']} threads)",
                  f"  floor (bytes / bandwidth): {m['floor_ms']:.2f} ms at the median; each round's median step "
                  f"over its own floor: {' '.join(f'{r:.2f}x' for r in ratios)}",
                  f"  median step {m['step_ms']:.2f} ms = {m['step_over_floor']:.2f}x the floor (median over "
                  f"rounds; {1 / m['step_over_floor']:.0%} of the limit)"]
    return "\n".join(lines)


# ---- entry point -----------------------------------------------------------------------------------------


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-sizes wants comma-separated positive integers, got {text!r}")
    return sizes


def run_bench(args, cfg: EngineConfig) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the oracle loads local files only; set before transformers
    from telemetry.logging import configure_logging

    configure_logging(args.log_format, args.log_level)
    batch_sizes, prompt_len, gen_len = _batch_sizes(args.batch_sizes), args.prompt_len, args.gen_len
    if prompt_len < 2 or gen_len < 1 or args.overhead_rounds < 1:
        raise ValueError("--prompt-len must be >= 2, --gen-len and --overhead-rounds >= 1")
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)  # one setting for both sides

    # The same prompts run several times: a prefix cache would turn later runs into cache hits, so the bench
    # measures prefill and decode with it off (benchmarks/prefix_cache_chat.py measures the cache itself).
    cfg = cfg.concrete().with_(disable_prefix_caching=True)
    model_config, model = load_model(cfg.model, dtype=getattr(torch, cfg.dtype), device=cfg.device,
                                     quantization=cfg.quantization, compile_layers=cfg.compile_decode)
    tokenizer = load_tokenizer(cfg.model)
    probe = probed_engine(cfg, model, tokenizer)  # both engines share the weights
    window = probe.engine.resolved.window
    probe_off = probed_engine(cfg.with_(telemetry=False), model, tokenizer)
    hf = None if args.skip_transformers else load_transformers(cfg)

    def prompts_for(batch: int) -> list[list[int]]:
        return synthetic_prompts(batch, prompt_len, model_config.vocab_size, model_config.bos_token_id, cfg.seed)

    warmup = [prompts_for(1)[0][:WARMUP_PROMPT_LEN]]
    for p in (probe, probe_off):
        run_ours(p, warmup, 2)
    if hf is not None:
        run_transformers(hf, warmup, 2)

    # Measured first, while both engines have served the same requests (slot order in the free lists and
    # the pools' touched pages then match, so only telemetry differs).
    buffer = read_buffer()
    overhead = telemetry_overhead({"on": probe, "off": probe_off}, prompts_for(min(batch_sizes)),
                                  max(gen_len, 2), args.overhead_rounds, progress=True,
                                  after_round=lambda: read_bandwidth(buffer=buffer))
    del buffer
    overhead_prompts, steps = prompts_for(min(batch_sizes)), max(gen_len, 2) - 1  # the first token: prefill's
    kv_read = statistics.mean(decode_kv_bytes(probe.engine.pool, model_config.sliding_window,
                                              [len(p) + i for p in overhead_prompts])
                              for i in range(1, steps + 1))  # step i: the prompt, i - 1 tokens and its own
    limit = memory_limit(model, overhead, kv_read)
    throughput, kv = [], []
    for batch in batch_sizes:
        prompts = prompts_for(batch)
        total = batch * (prompt_len + gen_len - 1)  # tokens through the model: prompts, then one per step
        with tqdm(total=total, desc=f"ours batch {batch}", unit="tok", leave=False) as bar:
            ours = run_ours(probe, prompts, gen_len, bar)
        theirs = None
        if hf is not None:
            with tqdm(total=total, desc=f"transformers batch {batch}", unit="tok", leave=False) as bar:
                theirs = run_transformers(hf, prompts, gen_len, bar)
        throughput.append(throughput_row(batch, gen_len, ours, theirs))
        kv.append(kv_row(probe.engine, batch, prompts, ours.kv_used))

    report = {
        "setup": {"model": str(cfg.model), "dtype": cfg.dtype, "quantization": cfg.quantization, "device": cfg.device, "threads": threads,
                  "attention_backend": cfg.attention_backend, "loc_cache": cfg.loc_cache, "graphs": cfg.graphs,
                  "prefix_cache": False,
                  "speculation": None if cfg.speculative_algorithm == "none" else (
                      f"{cfg.speculative_algorithm}, {cfg.num_speculative_tokens} draft tokens at most"),
                  "prompt_len": prompt_len, "gen_len": gen_len, "window": window,
                  "full_pool_tokens": probe.engine.resolved.full_pool_size,
                  "swa_pool_tokens": probe.engine.resolved.swa_pool_size,
                  "transformers": None if hf is None else f"transformers {_hf_version()} ({HF_ATTENTION} attention)"},
        "throughput": throughput,
        "kv": kv,
        "telemetry_overhead": overhead,
        "memory_limit": limit,
    }
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _hf_version() -> str:
    import transformers

    return transformers.__version__
