"""`swa-runtime generate` on the default model, as installed: the same greedy tokens as transformers."""

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow


def test_the_default_model_generates_what_transformers_generates(hf_gguf_model):
    result = subprocess.run([sys.executable, "-m", "runtime", "generate", "--prompt", "The capital of France is",
                             "--max-new-tokens", "8", "--json",
                             "--dtype", "float32", "--quantization", "none"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout)
    with torch.no_grad():
        ref = hf_gguf_model.generate(torch.tensor([row["input_ids"]]), max_new_tokens=8, min_new_tokens=8,
                                     do_sample=False)
    assert row["output_ids"] == ref[0, len(row["input_ids"]):].tolist()
    assert row["text"].strip() and row["text"] != row["prompt"]
