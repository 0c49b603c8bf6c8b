"""Engine options shared by `generate`, `bench` and `serve`: the argparse group and the config it yields.

Its own module so that the command line (`runtime/cli.py`) and the server launcher
(`runtime/server/launch.py`) both read it without importing each other.
"""

from __future__ import annotations

import argparse

from runtime.config import (BACKENDS, DTYPES, KV_SANITIZER_MODES, POLICIES, PREFILL_WEIGHTS, QUANTIZATIONS,
                            SPECULATIVE_ALGORITHMS, EngineConfig)
from runtime.faults import FAULTS
from runtime.tracing import PIP_LINE, check_endpoint


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=d.model, help="gemma3-270m (default), tiny, a .gguf file or a HF directory")
    g.add_argument("--dtype", choices=DTYPES, default=d.dtype,
                   help="activation (and KV cache) dtype; auto (default): the fastest measured on this kind of CPU "
                        "(bfloat16 where it has AVX2 or bfloat16 units, else float32; printed at start); float32 "
                        "is token-exact with transformers")
    g.add_argument("--quantization", choices=QUANTIZATIONS, default=d.quantization,
                   help="weight format: auto (default: int8-head on CPUs with bfloat16 units or AVX2 with FMA and "
                        "F16C, int8 on other AVX2 CPUs, else none), none (the --dtype), int8 (weight-only, per-channel scales: projections "
                        "and LM head) or int8-head (the --dtype for activations, norms and the KV cache; the LM head "
                        "and every projection through low-bit copies of the GGUF's own blocks: int4 where exactly "
                        "4-bit, int8 per block where Q8_0/Q5_0, else per-channel int8; for every row count where "
                        "the CPU has AVX512-VNNI or AVX2 and no AMX, for decode batches up to "
                        "64 rows with AMX)")
    g.add_argument("--lm-head-screen", choices=("on", "off"), default="on" if d.lm_head_screen else "off",
                   help="with int8-head on AVX512-VNNI or AVX2: a batch-1 decode step reads a 4-bit copy of the LM "
                        "head and every logit within 8 of the top is recomputed by the int8 head (the same greedy token and top "
                        "logits; 52 MB less a step for Gemma 3 270M); off: the int8 head alone")
    g.add_argument("--prefill-weights", choices=PREFILL_WEIGHTS, default=d.prefill_weights,
                   help="with int8-head on AVX512-VNNI or AVX2 without AMX, the rows past eight (prefill, decode "
                        "batches past eight): int8-128 (default), int8 weights and activations in blocks of 128, requantised from "
                        "the GGUF's at load (prefill's projections 1.2x; perplexity as gguf's on 4k tokens of prose, "
                        "+0.95%% against float32 on the fixed text of benchmarks/quality.py); gguf: the GGUF's own "
                        "blocks for every row count (their memory back)")
    g.add_argument("--compile-decode", action="store_true",
                   help="torch.compile each layer's math around its attention call (compiles on first use)")
    g.add_argument("--attention-backend", choices=BACKENDS, default=d.attention_backend)
    g.add_argument("--loc-cache", choices=POLICIES, default=d.loc_cache, help="full→SWA translation policy")
    g.add_argument("--loc-cache-guard", choices=("on", "off"), default="on",
                   help="guard on memo/layerwise entries: identity, contents, versions, mapping "
                        "(off reproduces the unguarded design)")
    g.add_argument("--loc-cache-verify", type=float, default=d.loc_cache_verify, metavar="RATE",
                   help="fraction of cache hits recomputed and compared (1: strict, no stale translation "
                        "is ever returned)")
    g.add_argument("--kv-sanitizer", choices=KV_SANITIZER_MODES, default=d.kv_sanitizer,
                   help="KV ownership checks (docs/kv-sanitizer.md): sampled (default: every write location, the "
                        "reads of one forward in 16), strict (every write and read of every forward), off")
    g.add_argument("--disable-graphs", action="store_true", help="run decode and speculative verify eagerly (no graph replay)")
    g.add_argument("--page-size", type=int, default=d.page_size)
    g.add_argument("--kv-cache-memory", type=memory_gib, default=d.kv_cache_memory, metavar="GIB|PCT%",
                   help="memory for K and V: GiB, or a percentage of the memory available now (e.g. 25%%); the "
                        "SWA pool is sized for --max-running-requests, the full pool gets the rest")
    g.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens,
                   help="full KV pool size in tokens (sizes the pools by hand instead of --kv-cache-memory)")
    g.add_argument("--swa-full-tokens-ratio", type=float, default=d.swa_full_tokens_ratio,
                   help="SWA pool size as a fraction of the full pool")
    g.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    g.add_argument("--context-length", "--max-model-len", dest="context_length", type=int, default=None,
                   metavar="TOKENS", help="the longest prompt + output served (default: the model's); "
                   "--max-model-len is vLLM's name for it")
    g.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size)
    g.add_argument("--hicache-size", type=int, default=d.hicache_size,
                   help="host-memory KV tier in tokens for requests retracted under pool pressure and prefix-cache "
                        "nodes evicted from the device (0: recompute, drop)")
    g.add_argument("--disable-prefix-caching", action="store_true",
                   help="prefill every prompt in full (no radix cache of finished requests' KV)")
    g.add_argument("--speculative-algorithm", choices=SPECULATIVE_ALGORITHMS, default=d.speculative_algorithm,
                   help="draft tokens without a draft model and verify them in one forward: ngram (prompt lookup "
                        "in the request's own tokens) or suffix (also learns earlier outputs); none (default)")
    g.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens,
                   help="most draft tokens per request and step")
    g.add_argument("--prompt-lookup-min", type=int, default=d.prompt_lookup_min,
                   help="shortest suffix (tokens) the ngram drafter looks up")
    g.add_argument("--prompt-lookup-max", type=int, default=d.prompt_lookup_max,
                   help="longest suffix (tokens) the ngram drafter looks up")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--inject", action="append", default=[], choices=sorted(FAULTS), metavar="FAULT",
                   help=f"reintroduce a historical bug (repeatable): {', '.join(FAULTS)}")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export OpenTelemetry traces (a span per request and per forward) to this OTLP/HTTP "
                        f"collector, e.g. http://localhost:4318 (needs: {PIP_LINE})")
    g.add_argument("--log-format", choices=("console", "json"), default="console")
    g.add_argument("--log-level", default="WARNING")


def memory_gib(text: str) -> float:
    """`--kv-cache-memory`: GiB, or `N%` of the memory available now (MemAvailable of /proc/meminfo)."""
    try:
        if text.endswith("%"):
            share = float(text[:-1]) / 100
            if not 0 < share <= 1:
                raise ValueError
            with open("/proc/meminfo") as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
            return share * kib / 2**20
        value = float(text)
    except (ValueError, OSError, StopIteration):
        raise argparse.ArgumentTypeError(f"--kv-cache-memory wants GiB (e.g. 2) or a percentage of the available "
                                         f"memory (e.g. 25%), got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--kv-cache-memory must be positive, got {text!r}")
    return value


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine options of `args` as command-line flags (those that differ from the defaults), to start
    another process (`swa-runtime serve`) with the same engine. Every engine option is spelt `--` + its
    dest with dashes; booleans are switches, lists repeat their flag."""
    probe = argparse.ArgumentParser(add_help=False)
    add_engine_args(probe)
    argv: list[str] = []
    for dest, default in vars(probe.parse_args([])).items():
        value = getattr(args, dest, default)
        if value == default:
            continue
        flag = "--" + dest.replace("_", "-")
        if isinstance(default, bool):
            argv += [flag] if value else []
        elif isinstance(value, list):
            argv += [x for v in value for x in (flag, str(v))]
        else:
            argv += [flag, str(value)]
    return argv


def announce_settings(cfg: EngineConfig) -> None:
    """Say at start what runs, and why where `auto` chose it (stderr: stdout may carry --json output)."""
    from runtime.auto_settings import describe
    from runtime.startup import announce

    announce(describe(cfg.dtype, cfg.quantization, cfg.auto_reason))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine config the options name, `auto` settings resolved for this CPU (`EngineConfig.concrete`);
    raises (before any model is loaded) for an option it cannot honour."""
    if args.otlp_traces_endpoint is not None:
        check_endpoint(args.otlp_traces_endpoint)
    return EngineConfig(
        model=args.model, dtype=args.dtype, quantization=args.quantization, compile_decode=args.compile_decode,
        lm_head_screen=args.lm_head_screen == "on", prefill_weights=args.prefill_weights,
        attention_backend=args.attention_backend, loc_cache=args.loc_cache,
        loc_cache_guard=args.loc_cache_guard == "on", loc_cache_verify=args.loc_cache_verify,
        kv_sanitizer=args.kv_sanitizer,
        graphs=not args.disable_graphs, page_size=args.page_size, max_total_tokens=args.max_total_tokens,
        swa_full_tokens_ratio=args.swa_full_tokens_ratio, max_running_requests=args.max_running_requests,
        kv_cache_memory=args.kv_cache_memory,
        context_length=args.context_length, chunked_prefill_size=args.chunked_prefill_size,
        hicache_size=args.hicache_size, disable_prefix_caching=args.disable_prefix_caching, seed=args.seed,
        speculative_algorithm=args.speculative_algorithm, num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
        inject=tuple(args.inject), otlp_traces_endpoint=args.otlp_traces_endpoint,
    ).concrete()
