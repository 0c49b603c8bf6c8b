"""`swa-runtime` command line: generate | bench | serve | fleet | diagnose.

Answers fast: nothing heavy (torch, the server) is imported to build the parser, so `--help` and a
mistyped option answer in well under a second. Options must be spelt out (no abbreviations: `--mod`
is not `--model`); an unknown one gets the closest real ones as a suggestion. Mistakes found later
(a model path, a taken port, a missing extra) end with one line that says what to do, status 2;
Ctrl-C before serving ends quietly with status 130.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import re
import sys

from runtime.bench_workloads import WORKLOADS
from runtime.config import BACKENDS, POLICIES
from runtime.faults import FAULTS
from runtime.fleet import add_fleet_args
from runtime.options import add_engine_args, announce_settings, engine_config
from runtime.server.openai_options import add_openai_args
from runtime.server.options import add_server_args


def parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--input-ids wants comma-separated integers, got {text!r}") from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"wants a whole number of at least 1, got {text!r}")
    return value


def cmd_generate(args: argparse.Namespace) -> int:
    from runtime.engine import Engine
    from runtime.core import SamplingParams
    from telemetry.logging import configure_logging

    configure_logging(args.log_format, args.log_level)
    if not args.prompt and not args.input_ids:
        print("error: give at least one --prompt or --input-ids", file=sys.stderr)
        return 2
    cfg = engine_config(args)
    announce_settings(cfg)
    engine = Engine(cfg, progress=not args.json)
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


# The extras a command needs beyond the core install: (module it imports, extra that installs it).
EXTRAS = {"serve": [("fastapi", "server"), ("uvicorn", "server")],
          "fleet": [("fastapi", "server"), ("uvicorn", "server"), ("sglang_router", "fleet")],
          "bench --serve": [("fastapi", "server"), ("uvicorn", "server"), ("httpx", "bench")]}


def require_extras(command: str) -> None:
    """Fail at once, with the pip line, when a module `command` needs is not installed."""
    missing = sorted({extra for module, extra in EXTRAS[command] if not _installed(module)})
    if missing:
        raise RuntimeError(f"`swa-runtime {command}` needs the {', '.join(missing)} extra: "
                           f"pip install 'swa-runtime[{','.join(missing)}]'")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: present in sys.modules as None (blocked)
        return False


def cmd_bench(args: argparse.Namespace) -> int:
    serve_only = [flag for flag, given in (("--workload", args.workload != "standard"),
                                           ("--compare-speculation", args.compare_speculation)) if given]
    if serve_only and not args.serve:
        raise ValueError(f"{' and '.join(serve_only)} {'apply' if len(serve_only) > 1 else 'applies'} to "
                         "`bench --serve` only: add --serve")
    cfg = engine_config(args)
    announce_settings(cfg)
    if args.serve:
        require_extras("bench --serve")
        from runtime.bench_serve import run_bench_serve, run_compare_speculation
        from runtime.options import engine_argv

        if args.compare_speculation:
            return run_compare_speculation(args, cfg)
        return run_bench_serve(args, cfg, engine_argv(args))
    from runtime.bench import run_bench

    return run_bench(args, cfg)


def cmd_serve(args: argparse.Namespace) -> int:
    from runtime.startup import announce, bind_port

    listener = bind_port(args.host, args.port)  # first: a taken port fails before anything is imported
    require_extras("serve")
    announce(f"{args.host}:{args.port} is free; loading the server")
    from runtime.server.launch import serve

    return serve(args, listener)


def cmd_fleet(args: argparse.Namespace) -> int:
    require_extras("fleet")
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


# What `serve` answers (the banner lists the same, read from the app's routes; a test holds them equal).
SERVE_ROUTES = ("POST /v1/chat/completions, /v1/completions, /generate, /abort_request; GET /v1/models, /health, "
                "/metrics, /server_info, /model_info, /get_server_info, /get_model_info, /get_load")


class Parser(argparse.ArgumentParser):
    """No abbreviated options, and suggestions for a mistyped one."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        unknown = re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", message.partition("unrecognized arguments:")[2])
        if unknown:
            known = set(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", self.format_help()))
            hints = [f"{u}: did you mean {' or '.join(m)}?" for u in unknown
                     if (m := difflib.get_close_matches(u.split("=")[0], known, n=2, cutoff=0.6))]
            if hints:
                message += " (" + "; ".join(hints) + ")"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="swa-runtime", description="Hybrid sliding-window-attention inference "
                    "runtime with an observable KV location translation cache")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    parser.set_defaults(subparsers=sub.choices)

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
    served.add_argument("--rounds", type=positive_int, default=1,
                        help="times each server runs each level, taking turns (the order turned each round); the "
                        "ratios against a --peer then give the range of the rounds' own")
    served.add_argument("--peer", metavar="URL", action="append", default=None,
                        help="another OpenAI-compatible server to hold it against (repeatable)")
    served.add_argument("--peer-model", metavar="NAME", action="append", default=None,
                        help="the `model` field sent to the --peer of the same position (default: default); its rows "
                        "are labelled `peer NAME`")
    served.add_argument("--stall-body-mb", type=float, default=4.0, help="body another client sends mid-stream")
    served.add_argument("--transformers-max-batch", type=int, default=8, help="largest static batch for transformers")
    served.add_argument("--workload", choices=WORKLOADS, default="standard",
                        help="standard: synthetic token ids, nothing to copy; copy: code-editing requests over "
                        "passages of the runtime's own source, whose greedy answers copy the passage (no "
                        "transformers rows: its prompts differ in length)")
    served.add_argument("--compare-speculation", action="store_true",
                        help="run two servers, speculation off and on (the --speculative-* options given; "
                        "ngram where none), taking turns on the same prompts, and print them side by side with "
                        "the ratio and the acceptance (no peer, offline or transformers rows)")
    bench.set_defaults(func=cmd_bench)

    serve = sub.add_parser("serve", help="HTTP server: the OpenAI API (/v1/chat/completions, /v1/completions), "
                           "/generate, /metrics, /health", description=f"Serve the model over HTTP: {SERVE_ROUTES}.")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM/SIGINT, let running requests finish this long, then abort them")
    serve.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn)")
    add_server_args(serve)
    add_openai_args(serve)
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
    from runtime.startup import mark_start

    mark_start()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the subcommand's parser, which knows the options to suggest
        args.subparsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except (ValueError, RuntimeError, OSError) as exc:  # mistakes in what was asked: say what to do
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("swa-runtime: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
