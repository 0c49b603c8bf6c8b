"""OpenTelemetry traces (`--otlp-traces-endpoint URL`): a span per request and per forward, key-change and
sanitizer events as events of the forward span that links to the requests it ran (docs/tracing.md).

Optional: the OpenTelemetry SDK and its OTLP/HTTP exporter are the `[tracing]` extra, imported only when an
endpoint is set (`make_tracer`). Without one the engine holds no tracer and its hooks are `None` checks, so
tracing off costs nothing on the hot path. This module imports nothing heavy: the CLI and the config check
the option through it before any model is loaded.
"""

from __future__ import annotations

import importlib.util
from urllib.parse import urlsplit

PIP_LINE = "pip install 'swa-runtime[tracing]'"
_REQUIRED = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")
TRACES_PATH = "/v1/traces"


class TracingUnavailable(RuntimeError):
    """An endpoint is set but the OpenTelemetry packages are not installed."""


def require_sdk() -> None:
    """Fail fast, with the pip line, if the tracing extra is missing (looks modules up without importing)."""
    missing = [name for name in _REQUIRED if not _installed(name)]
    if missing:
        raise TracingUnavailable(f"--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP/HTTP exporter "
                                 f"({', '.join(missing)} not found): {PIP_LINE}")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def traces_url(endpoint: str) -> str:
    """The URL spans are POSTed to: `endpoint` as given, or with `/v1/traces` appended when it names only a
    collector (`http://localhost:4318`), as the OTLP/HTTP convention for a base endpoint has it. Raises
    ValueError for anything but an http(s) URL with a host."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--otlp-traces-endpoint wants an http(s) URL of an OTLP/HTTP collector, e.g. "
                         f"http://localhost:4318{TRACES_PATH}, got {endpoint!r}")
    if parts.path in ("", "/"):
        return endpoint.rstrip("/") + TRACES_PATH
    return endpoint


def check_endpoint(endpoint: str) -> str:
    """The collector URL of `endpoint` once tracing is known to be able to run there: raises ValueError for a
    bad URL, TracingUnavailable without the SDK. Call it before loading a model, to fail fast."""
    url = traces_url(endpoint)
    require_sdk()
    return url


def make_tracer(endpoint: str, build):
    """An `EngineTracer` exporting to `endpoint` (imports the SDK now; `build`: the engine's BuildInfo)."""
    url = check_endpoint(endpoint)
    from runtime.tracing.tracer import EngineTracer

    return EngineTracer.to_endpoint(url, build)
