"""Model-test fixtures: a dense reference attention backend, and the real model as loaded by us and by
transformers (session-scoped: each costs tens of seconds)."""

import pytest
import torch

from runtime.context import ForwardContext, forward_context


class DenseCausalBackend:
    """Reference attention over the T tokens of one sequence (token i at relative position i): causal, and
    on sliding layers limited to the last `sliding_window` tokens. No KV cache. Computes in float32.

    `respect_window=False` turns sliding layers into global ones (to show that the window matters);
    `calls` records what each layer handed over.
    """

    def __init__(self, respect_window: bool = True) -> None:
        self.respect_window = respect_window
        self.calls = []

    def forward(self, q, k, v, layer):  # q (T, H, D), k/v (T, Hkv, D) -> (T, H, D)
        self.calls.append((layer.layer_id, layer.sliding_window, layer.scaling, q.shape, k.shape, v.shape, q.dtype))
        T, H, _ = q.shape
        group = H // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1)  # (T, H, D): query head h reads kv head h // group
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * layer.scaling  # (H, T, T)
        i = torch.arange(T)
        visible = i[None, :] <= i[:, None]  # (Tq, Tk)
        if self.respect_window and layer.sliding_window is not None:
            visible &= i[:, None] - i[None, :] < layer.sliding_window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)  # (T, H, D)


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
def gguf_reader(gemma3_gguf_path):
    """One parsed `gguf.GGUFReader` of the default model (parsing takes ~10 s)."""
    from gguf import GGUFReader

    return GGUFReader(str(gemma3_gguf_path))


@pytest.fixture(scope="session")
def our_gguf_f32(gguf_reader):
    """(config, state_dict) from our loader, float32 (what `load_gguf` returns, without a second parse)."""
    from runtime.models.loader import config_from_gguf, state_dict_from_gguf

    return config_from_gguf(gguf_reader), state_dict_from_gguf(gguf_reader, torch.float32, progress=False)
