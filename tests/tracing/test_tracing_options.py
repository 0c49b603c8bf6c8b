"""`--otlp-traces-endpoint`: checked before any model loads, passed on to other processes, and with no
endpoint nothing of OpenTelemetry is even imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runtime import tracing
from runtime.cli import build_parser, main
from runtime.options import engine_argv, engine_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("endpoint, url", [
    ("http://localhost:4318", "http://localhost:4318/v1/traces"),
    ("http://localhost:4318/", "http://localhost:4318/v1/traces"),
    ("https://tempo.example:4318/v1/traces", "https://tempo.example:4318/v1/traces"),
    ("http://collector/otlp/v1/traces", "http://collector/otlp/v1/traces"),
])
def test_a_base_endpoint_gets_the_traces_path(endpoint, url):
    assert tracing.traces_url(endpoint) == url


@pytest.mark.parametrize("endpoint", ["localhost:4318", "grpc://localhost:4317", "http://", "/v1/traces"])
def test_a_bad_endpoint_is_a_one_line_error_before_loading(endpoint, capsys):
    # --model names a file that does not exist: reaching the loader would fail differently
    assert main(["generate", "--model", "/nonexistent.gguf", "--prompt", "hi",
                 "--otlp-traces-endpoint", endpoint]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --otlp-traces-endpoint wants an http(s) URL") and err.count("\n") == 1


def test_a_missing_sdk_names_the_pip_line(monkeypatch):
    monkeypatch.setattr(tracing, "_REQUIRED", ("opentelemetry.sdk", "opentelemetry_exporter_not_installed.http"))
    with pytest.raises(tracing.TracingUnavailable) as info:
        tracing.check_endpoint("http://localhost:4318")
    assert tracing.PIP_LINE in str(info.value) and "opentelemetry_exporter_not_installed.http" in str(info.value)


def test_the_endpoint_travels_to_other_processes():
    args = build_parser().parse_args(["serve", "--otlp-traces-endpoint", "http://127.0.0.1:4318"])
    assert engine_config(args).otlp_traces_endpoint == "http://127.0.0.1:4318"
    assert engine_argv(args)[-2:] == ["--otlp-traces-endpoint", "http://127.0.0.1:4318"]
    assert "--otlp-traces-endpoint" not in engine_argv(build_parser().parse_args(["serve"]))


def test_tracing_off_imports_no_opentelemetry():
    """Zero cost when off, checked as a fact: an engine that served requests without an endpoint has no
    tracer, and no OpenTelemetry module (nor the tracer module) was ever imported into its process."""
    code = (
        "import sys\n"
        "from runtime.config import EngineConfig\n"
        "from runtime.core import SamplingParams\n"
        "from runtime.engine import Engine\n"
        "e = Engine(EngineConfig(model='tiny', max_total_tokens=512, swa_full_tokens_ratio=0.5), progress=False)\n"
        "out = e.generate([[2, 3, 4], [5, 6, 7, 8]], SamplingParams(max_new_tokens=4, ignore_eos=True))\n"
        "e.close()\n"
        "assert e.tracer is None and e.runner.tracer is None and e.scheduler.tracer is None\n"
        "loaded = [m for m in sys.modules if m.startswith(('opentelemetry', 'runtime.tracing.tracer'))]\n"
        "print(sorted(loaded), len(out[1]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["[]", "4"]
