"""`swa-runtime serve`: start the engine in its own process, serve it with uvicorn, drain on SIGTERM/SIGINT.

Start-up talks: the port is bound first (a taken port fails in a second, before any loading), then each
phase is announced on stderr as it starts (resolve the model, tokenizer, engine process: weights with a
bar, warm-up and graph capture), then the line that says where it listens and which routes it serves.

This process is the front end: it tokenizes, streams and serves `/metrics`; the engine process does every
forward on its own main thread (`runtime/server/engine_process.py`).

On the first SIGTERM or SIGINT the engine stops admitting: the listener stays open and new requests, on new
or kept-alive connections, get 503 with `Connection: close` (`/health` too, so a router stops routing here);
running requests may finish for `--shutdown-timeout` seconds, the rest are aborted (counted `aborted`; their
clients get a 503 or, streaming, an error event). Once the engine process has exited, uvicorn closes its
connections and the process exits with status 0. A second SIGINT or SIGTERM stops uvicorn's wait for the
drain; a third SIGINT forces it to quit at once. Limits and site checks: `runtime/server/options.py`.

The engine process is supervised (`supervisor.py`): restarted when it dies or hangs, until its restart
budget is spent; then the server exits with status 3 (`EXIT_ENGINE_GAVE_UP`) for an outside supervisor.
"""

from __future__ import annotations

import argparse
import multiprocessing
import signal
import socket
import sys
import threading
import time

import uvicorn

from runtime.options import announce_settings, engine_config
from runtime.server.chat_template import ChatPrompt
from runtime.server.engine_process import EngineProcess
from runtime.server.openai_options import OpenAIOptions
from runtime.server.options import ServerOptions
from runtime.startup import announce, bind_port
from runtime.server.supervisor import EngineSupervisor, SupervisionPolicy
from telemetry.stats import FrontEndStats

EXIT_ENGINE_GAVE_UP = 3


class _DrainingServer(uvicorn.Server):
    """uvicorn, but its exit signal first tells the engine to stop admitting and start draining."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineProcess, shutdown_timeout_s: float):
        super().__init__(config)
        self.engine_loop = engine_loop
        self.shutdown_timeout_s = shutdown_timeout_s

        self.gave_up: str | None = None
        self._draining = False

    def handle_exit(self, sig, frame) -> None:
        if self._draining:  # a second signal: stop waiting for the drain (SIGINT again: force)
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self.engine_loop.begin_shutdown(self.shutdown_timeout_s)
        threading.Thread(target=self._exit_when_drained, args=(sig,), name="swa-runtime-drain", daemon=True).start()

    def _exit_when_drained(self, sig) -> None:
        """Keep answering (503 + Connection: close) until the engine has drained and exited, then stop."""
        deadline = time.monotonic() + self.shutdown_timeout_s + 30.0
        while not self.engine_loop.exited and time.monotonic() < deadline:
            time.sleep(0.05)
        super().handle_exit(sig, None)

    def give_up(self, reason: str) -> None:
        """The engine supervisor spent its restart budget: stop serving, exit non-zero."""
        self.gave_up = reason
        self.should_exit = True


def _exit_cleanly(signum, frame) -> None:
    # uvicorn re-raises the signal that stopped it once it has shut down; by then the drain is complete.
    raise SystemExit(0)


def serve(args: argparse.Namespace, listener: socket.socket | None = None) -> int:
    """Build (each phase announced as it starts), then serve on `listener` (bound by the CLI before anything
    was imported: `startup.bind_port`). Mistakes found on the way raise ValueError/RuntimeError/OSError with
    one line that says how to fix them (the CLI prints it)."""
    if listener is None:
        listener = bind_port(args.host, args.port)
    from runtime.models.registry import check_model_files, resolve_model
    from runtime.models.tokenizer import load_tokenizer
    from runtime.server.app import create_app
    from runtime.server.connections import uvicorn_config
    from telemetry.logging import configure_logging, instance_of

    instance = instance_of(args.host, args.port)  # every log record names this replica as Prometheus does
    configure_logging(args.log_format, args.log_level, instance=instance)
    cfg = engine_config(args)
    announce_settings(cfg)
    opts = ServerOptions.from_args(args)
    api = OpenAIOptions.from_args(args)
    announce(f"resolving the model {cfg.model}")
    source = resolve_model(cfg.model)
    check_model_files(source)
    engine_loop = EngineProcess(cfg, None, max_queued_requests=opts.max_queued_requests,
                                log_requests=opts.log_requests, log_format=args.log_format, log_level=args.log_level,
                                instance=instance)
    announce("starting the engine process (it loads the weights, warms up and captures decode graphs)")
    try:
        engine_loop.launch()
        # the front end's own tokenizer meanwhile (1-2 s that the engine process's start-up no longer waits for)
        announce("loading the tokenizer")
        engine_loop.tokenizer = load_tokenizer(cfg.model)
        chat_prompt = ChatPrompt.load(api.chat_template, cfg.model, engine_loop.tokenizer)
        announce(f"chat prompts: {chat_prompt.origin}")
        engine_loop.wait_started()  # returns once the engine process has built the engine
    except BaseException:  # a bad chat template, a failed start, Ctrl-C: no engine process left behind
        for child in multiprocessing.active_children():  # it ignores SIGINT/SIGTERM: the front end decides
            child.kill()
        raise
    stats = FrontEndStats()
    app = create_app(engine_loop, model_name=source.name, options=opts, openai=api, chat_prompt=chat_prompt,
                     front_end_stats=stats)
    config = uvicorn_config(app, opts, timeout_graceful_shutdown=opts.shutdown_timeout_s + 5)
    server = _DrainingServer(config, engine_loop, opts.shutdown_timeout_s)
    supervisor = EngineSupervisor(engine_loop, stats, supervision_policy(opts), on_give_up=server.give_up)
    supervisor.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    announce(f"listening on http://{args.host}:{args.port} serving {app.state.model_name}: {routes_of(app)}")
    server.run(sockets=[listener])
    supervisor.stop()
    if server.gave_up is not None:
        print(f"swa-runtime: giving up: {server.gave_up}", file=sys.stderr, flush=True)
        return EXIT_ENGINE_GAVE_UP
    return 0 if server.started else 1


def routes_of(app) -> str:
    """`POST /v1/chat/completions, ...; GET /v1/models, ...`: what the app answers (docs pages aside)."""
    by_method: dict[str, list[str]] = {}
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            if method in ("GET", "POST") and route.path not in ("/docs", "/redoc", "/openapi.json",
                                                                 "/docs/oauth2-redirect"):
                by_method.setdefault(method, []).append(route.path)
    return "; ".join(f"{m} {', '.join(paths)}" for m, paths in sorted(by_method.items(), reverse=True))


def supervision_policy(opts: ServerOptions) -> SupervisionPolicy:
    return SupervisionPolicy(heartbeat_timeout_s=opts.engine_heartbeat_timeout_s, hang_kill_s=opts.engine_hang_kill_s,
                             max_restarts=opts.engine_max_restarts)
