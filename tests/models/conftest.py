"""Model-test fixtures: a dense reference attention backend, and the real model as loaded by us and by
transformers (session-scoped: each costs tens of seconds)."""

import pytest
import torch

from dense_backend import DenseCausalBackend  # noqa: E402  (a uniquely named module beside this file)
from runtime.context import ForwardContext, forward_context


@pytest.fixture
def run_dense():
    """run_dense(model, ids, positions=None, backend=None) -> (T, vocab) float32 logits of one sequence."""

    def run(model, ids, positions=None, backend=None):
        ids = torch.as_tensor(ids)
        positions = torch.arange(ids.numel()) if positions is None else torch.as_tensor(positions)
        ctx = ForwardContext(forward_id=1, mode="eager_extend", attn_backend=backend or DenseCausalBackend())
        with torch.no_grad(), forward_context(ctx):
            return model.compute_logits(model(ids, positions))

    return run


@pytest.fixture(scope="session")
def hf_gguf_model(gemma3_gguf_path):
    """transformers' Gemma3ForCausalLM built by `from_pretrained(dir, gguf_file=...)` from the same file,
    float32, eager attention.

    NOTE: `from_pretrained` refuses GGUF files unless `accelerate` is installed, which it does not use on
    this path (gemma3 goes through the legacy `load_gguf_checkpoint` with full dequantisation). The guard
    is lifted for this call only.
    """
    import transformers.modeling_utils as modeling_utils
    from transformers import AutoModelForCausalLM

    mp = pytest.MonkeyPatch()
    mp.setattr(modeling_utils, "is_accelerate_available", lambda: True)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gemma3_gguf_path.parent), gguf_file=gemma3_gguf_path.name,
            dtype=torch.float32, attn_implementation="eager", local_files_only=True,
        )
    finally:
        mp.undo()
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def gguf_file(gemma3_gguf_path):
    """The default model's GGUF file, opened (`runtime.models.gguf_file`)."""
    from runtime.models.gguf_file import GGUFFile

    return GGUFFile(gemma3_gguf_path)


@pytest.fixture(scope="session")
def our_gguf_f32(gguf_file):
    """(config, state_dict) from our loader, float32 (what `load_gguf` returns, without a second parse)."""
    from runtime.models.loader import config_from_gguf, state_dict_from_gguf

    return config_from_gguf(gguf_file), state_dict_from_gguf(gguf_file, torch.float32, progress=False)
