"""`swa-runtime generate` as a user runs it: a subprocess, JSON out, clear errors."""

import json
import subprocess
import sys

import pytest
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.core import SamplingParams
from runtime.models.tokenizer import ByteTokenizer


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime", "generate", "--model", "tiny", *args],
                          capture_output=True, text=True, timeout=300)


def test_json_output_matches_the_engine_for_text_and_id_prompts():
    result = cli("--prompt", "sliding windows", "--input-ids", "2,40,41,42,43", "--max-new-tokens", "6", "--json")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    tok = ByteTokenizer()
    assert [r["input_ids"] for r in rows] == [tok.encode("sliding windows"), [2, 40, 41, 42, 43]]
    engine = Engine(EngineConfig(model="tiny"), progress=False)
    expected = engine.generate([r["input_ids"] for r in rows], SamplingParams(max_new_tokens=6))
    assert [r["output_ids"] for r in rows] == expected
    assert [r["text"] for r in rows] == [tok.decode(ids) for ids in expected]


@pytest.mark.parametrize("args, message", [
    (("--input-ids", "2,99999"), "token ids must be integers within [0, 260)"),
    (("--prompt", "hi", "--max-new-tokens", "0"), "max_new_tokens must be a positive integer"),
    (("--prompt", "hi", "--max-total-tokens", "16", "--swa-full-tokens-ratio", "0.5"),
     "cannot hold one sliding window (8) plus a page"),
    ((), "give at least one --prompt or --input-ids"),
    (("--input-ids", "1,x"), "comma-separated integers"),
])
def test_bad_input_exits_2_with_a_message(args, message):
    result = cli(*args)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_bfloat16_model_says_it_loads_the_kernels_before_its_weights(dtype):
    """The weights' low-bit copies are made on the kernels, and a machine's first start builds them then: the line
    that says so must come first, not after a silent wait inside "loading the weights". float32 never uses them."""
    from runtime import kernels

    if dtype == "bfloat16" and kernels.load() is None:
        pytest.skip(f"the fused CPU kernels are not built here: {kernels.failure()}")
    result = cli("--prompt", "hi", "--max-new-tokens", "2", "--dtype", dtype, "--quantization", "none")
    assert result.returncode == 0, result.stderr
    weights = result.stderr.index("loading the weights of tiny")
    if dtype == "float32":
        assert "fused CPU kernels" not in result.stderr
    else:
        assert 0 <= result.stderr.index("fused CPU kernels: loading") < weights
