"""`swa-runtime` command line: generate | bench | serve | fleet | diagnose."""

from __future__ import annotations

import argparse
import json
import sys

from runtime.config import BACKENDS, POLICIES
from runtime.faults import FAULTS
from runtime.fleet import add_fleet_args
from runtime.options import add_engine_args, engine_config
from runtime.server.options import add_server_args


def parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--input-ids wants comma-separated integers, got {text!r}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    from runtime.engine import Engine
    from runtime.core import SamplingParams
    from telemetry.logging import configure_logging

    configure_logging(args.log_format, args.log_level)
    if not args.prompt and not args.input_ids:
        print("error: give at least one --prompt or --input-ids", file=sys.stderr)
        return 2
    engine = Engine(engine_config(args), progress=not args.json)
    tok = engine.tokenizer
    prompts = [(text, tok.encode(text)) for text in args.prompt] + [(None, ids) for ids in args.input_ids]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, ignore_eos=args.ignore_eos)
    outputs = engine.generate([ids for _, ids in prompts], params)
    for (text, ids), out in zip(prompts, outputs):
        completion = tok.decode(out)
        if args.json:
            print(json.dumps({"prompt": text, "input_ids": ids, "output_ids": out, "text": completion}))
        else:
            print(f"--- {text if text is not None else ids}\n{completion}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.serve:
        from runtime.bench_serve import run_bench_serve
        from runtime.options import engine_argv

        return run_bench_serve(args, engine_config(args), engine_argv(args))
    from runtime.bench import run_bench

    return run_bench(args, engine_config(args))


def cmd_serve(args: argparse.Namespace) -> int:
    from runtime.server.launch import serve

    return serve(args)


def cmd_fleet(args: argparse.Namespace) -> int:
    from runtime.fleet import run_fleet

    return run_fleet(args)


def cmd_diagnose(args: argparse.Namespace) -> int:
    from runtime.diagnose import render, run_diagnose
    from telemetry.logging import configure_logging

    if args.from_log:
        return diagnose_from_log(args)
    configure_logging(args.log_format, args.log_level)
    report = run_diagnose(model=args.model, policies=tuple(args.policy) or POLICIES, inject=tuple(args.inject),
                          guard=args.loc_cache_guard == "on", verify=args.loc_cache_verify, seed=args.seed,
                          attention_backend=args.attention_backend, threads=args.threads)
    print(json.dumps(report.as_dict(), indent=2) if args.json else render(report))
    return report.exit_status


def diagnose_from_log(args: argparse.Namespace) -> int:
    """`diagnose --from-log`: the same table from engines' JSON logs instead of a workload run."""
    from runtime.diagnose.from_log import diagnose_logs

    workload_only = [flag for flag, given in (("--inject", args.inject), ("--policy", args.policy)) if given]
    if workload_only:
        print(f"error: {' and '.join(workload_only)} choose what the workload runs; they do not apply with "
              "--from-log", file=sys.stderr)
        return 2
    report = diagnose_logs(args.from_log, stdin=sys.stdin.buffer)
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.render())
    return report.exit_status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swa-runtime", description="Hybrid sliding-window-attention inference "
                                     "runtime with an observable KV location translation cache")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation for one or more prompts")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    gen.add_argument("--input-ids", action="append", type=parse_ids, default=[], help="comma-separated token ids")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="throughput vs transformers, KV bytes, telemetry overhead")
    add_engine_args(bench)
    bench.add_argument("--prompt-len", type=int, default=600, help="prompt tokens (longer than the window)")
    bench.add_argument("--gen-len", type=int, default=32)
    bench.add_argument("--batch-sizes", default="1,8")
    bench.add_argument("--skip-transformers", action="store_true")
    bench.add_argument("--threads", type=int, default=None, help="torch threads for both sides (default: torch's)")
    bench.add_argument("--overhead-rounds", type=int, default=6,
                       help="on/off run pairs of the telemetry-overhead measurement")
    bench.add_argument("--json", metavar="PATH", default=None, help="also write the numbers to PATH as JSON")
    served = bench.add_argument_group("through the server (--serve)")
    served.add_argument("--serve", action="store_true",
                        help="measure through `swa-runtime serve` and the OpenAI API at each --concurrency")
    served.add_argument("--concurrency", default="1,8,32", help="concurrent clients, comma-separated")
    served.add_argument("--min-requests", type=int, default=3, help="requests per level at least")
    served.add_argument("--peer", metavar="URL", default=None, help="another OpenAI-compatible server to hold it against")
    served.add_argument("--peer-model", default="default", help="the `model` field sent to --peer")
    served.add_argument("--stall-body-mb", type=float, default=4.0, help="body another client sends mid-stream")
    served.add_argument("--transformers-max-batch", type=int, default=8, help="largest static batch for transformers")
    bench.set_defaults(func=cmd_bench)

    serve = sub.add_parser("serve", help="HTTP server: /generate, /v1/completions, /metrics, /health")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM/SIGINT, let running requests finish this long, then abort them")
    serve.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn)")
    add_server_args(serve)
    serve.set_defaults(func=cmd_serve)

    fleet = sub.add_parser("fleet", help="N serve replicas on loopback behind the SGLang router, supervised")
    add_engine_args(fleet)
    add_fleet_args(fleet)
    fleet.set_defaults(func=cmd_fleet)

    diag = sub.add_parser("diagnose", help="run every forward mode, policy and memory path, hold the outputs against "
                          "a dense reference, report translation-cache events with their origin and a suggested fix "
                          "(exit 1 on any bug-class event, undetected corruption or path never taken)")
    diag.add_argument("--model", default="tiny", help="tiny (default), gemma3-270m, a .gguf file or a HF directory")
    diag.add_argument("--policy", action="append", default=[], choices=POLICIES,
                      help="translation policy to run (repeatable; default: all)")
    diag.add_argument("--inject", action="append", default=[], choices=sorted(FAULTS), metavar="FAULT",
                      help=f"reintroduce a historical bug (repeatable): {', '.join(FAULTS)}")
    diag.add_argument("--loc-cache-guard", choices=("on", "off"), default="on")
    diag.add_argument("--loc-cache-verify", type=float, default=0.0, metavar="RATE")
    diag.add_argument("--attention-backend", choices=BACKENDS, default="torch")
    diag.add_argument("--seed", type=int, default=0)
    diag.add_argument("--threads", type=int, default=1, help="torch threads (default 1: fast and reproducible)")
    diag.add_argument("--json", action="store_true", help="print the report as JSON (rows, totals, exit status)")
    diag.add_argument("--from-log", action="extend", nargs="+", default=[], metavar="FILE",
                      help="instead of running the workload, read engines' --log-format json logs (- for stdin; "
                      "several files, or the flag repeated, for several replicas) and report their events")
    diag.add_argument("--log-format", choices=("console", "json"), default="console")
    diag.add_argument("--log-level", default="WARNING")
    diag.set_defaults(func=cmd_diagnose)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError) as exc:  # configuration and capacity errors: say what is wrong
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
