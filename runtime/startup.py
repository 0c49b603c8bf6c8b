"""Start-up that talks: each slow phase is announced on stderr as it begins, with the seconds since start.

A user who starts `serve` sees at once what it is doing (resolving or assembling the model, the tokenizer,
the weights with a bar, warm-up and graph capture, then where it listens) instead of silence for half a
minute. One line per phase, `swa-runtime [  3.2s] loading weights ...`, flushed at once.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import time

# The command's start (set by the CLI), shared with the engine process it spawns through the environment, so
# that the engine's phases count from the same moment.
_START_ENV = "SWA_RUNTIME_STARTED_AT"
_IMPORTED_AT = time.time()


def mark_start() -> None:
    """This command starts now (each `swa-runtime` invocation, also a replica started by `fleet`)."""
    os.environ[_START_ENV] = repr(time.time())


def announce(what: str) -> None:
    start = float(os.environ.get(_START_ENV, _IMPORTED_AT))
    print(f"swa-runtime [{time.time() - start:5.1f}s] {what}", file=sys.stderr, flush=True)


def bind_port(host: str, port: int) -> socket.socket:
    """The server's socket, bound now (uvicorn listens on it later) so that a taken port fails before
    anything is loaded; else an OSError that names the fix."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        taken = exc.errno == errno.EADDRINUSE
        why = "is already in use (another server?)" if taken else f"cannot be bound ({exc.strerror})"
        raise OSError(f"port {port} on {host} {why}: stop that process or pick another with --port") from None
    return sock
