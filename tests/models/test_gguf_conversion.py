"""Our GGUF conversion against the one transformers performs on the same file."""

import numpy as np
import pytest
import torch

from runtime.models.config import FULL, SLIDING
from runtime.models.loader import gguf_to_param_name

pytestmark = pytest.mark.slow


def test_every_tensor_equals_transformers_dequantised_tensor(our_gguf_f32, hf_gguf_model):
    _, ours = our_gguf_f32
    ref = dict(hf_gguf_model.state_dict())
    # tied head: transformers' lm_head *is* the embedding; the file has no output.weight
    assert hf_gguf_model.lm_head.weight.data_ptr() == hf_gguf_model.model.embed_tokens.weight.data_ptr()
    del ref["lm_head.weight"]
    assert len(ours) == 236
    assert ours.keys() == ref.keys()
    different = [name for name in ours if ours[name].shape != ref[name].shape or not torch.equal(ours[name], ref[name])]
    assert different == []


def test_norm_weights_are_stored_as_one_plus_w_in_the_file(gguf_file, our_gguf_f32):
    _, ours = our_gguf_f32
    norms = [t for t in gguf_file.tensors if t.name.endswith("norm.weight")]
    assert len(norms) == 1 + 18 * 6  # output_norm; per layer: attn, post_attention, ffn, post_ffw, q, k
    for tensor in norms:
        raw = torch.from_numpy(np.array(tensor.data, dtype=np.float32))
        torch.testing.assert_close(ours[gguf_to_param_name(tensor.name)] + 1, raw, rtol=0, atol=1e-6)
    # The zero-centred form is the one that makes sense: RMSNorm weights sit around 1 in ggml's form.
    assert ours["model.layers.0.input_layernorm.weight"].mean() + 1 > 0


def test_config_matches_the_config_transformers_reads_from_the_file(our_gguf_f32, hf_gguf_model):
    ours, ref = our_gguf_f32[0], hf_gguf_model.config
    assert tuple(ref.layer_types) == ours.layer_types
    assert ours.full_layer_ids == (5, 11, 17)
    assert ref.rope_parameters[FULL]["rope_theta"] == ours.rope_theta == 1_000_000.0
    assert ref.rope_parameters[SLIDING]["rope_theta"] == ours.rope_local_base_freq == 10_000.0
    assert ref.rope_parameters[FULL]["rope_type"] == "default" and ours.rope_scaling is None
    assert ref.sliding_window == ours.sliding_window == 512
    assert ref.query_pre_attn_scalar == ours.query_pre_attn_scalar == 256
    assert ref.tie_word_embeddings and ours.tie_word_embeddings
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                 "hidden_activation", "final_logit_softcapping", "attn_logit_softcapping",
                 "bos_token_id", "pad_token_id"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert ours.eos_token_ids == (ref.eos_token_id,)
    assert (ours.vocab_size, ours.hidden_size, ours.num_hidden_layers, ours.head_dim) == (262144, 640, 18, 256)
    assert (ours.num_attention_heads, ours.num_key_value_heads) == (4, 1)
