import dataclasses

import pytest
from transformers import Gemma3TextConfig

from runtime.models.config import FULL, SLIDING, Gemma3Config, RopeScaling, pattern_layer_types


def test_gemma3_pattern_puts_a_global_layer_after_every_five_sliding_ones():
    types = pattern_layer_types(18)
    assert [i for i, t in enumerate(types) if t == FULL] == [5, 11, 17]
    assert types.count(SLIDING) == 15


def test_tiny_config_has_two_global_layers_each_after_sliding_ones():
    cfg = Gemma3Config.tiny()
    assert cfg.layer_types == (SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL)
    assert cfg.full_layer_ids == (2, 5) and cfg.sliding_layer_ids == (0, 1, 3, 4)
    assert [cfg.layer_window(i) for i in range(6)] == [8, 8, None, 8, 8, None]
    assert [cfg.rope_base(i) for i in (0, 2)] == [10_000.0, 1_000_000.0]
    assert cfg.attn_scaling == 16**-0.5


def test_config_is_frozen_and_changes_make_a_new_validated_config():
    cfg = Gemma3Config.tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.sliding_window = 4
    smaller = cfg.with_(sliding_window=4)
    assert (smaller.sliding_window, cfg.sliding_window) == (4, 8)
    with pytest.raises(ValueError, match="layer_types"):
        cfg.with_(num_hidden_layers=5)
    with pytest.raises(ValueError, match="group evenly"):
        cfg.with_(num_key_value_heads=3)


def test_transformers_builds_the_same_config_from_our_hf_dict():
    cfg = Gemma3Config.tiny().with_(rope_scaling=RopeScaling("linear", 8.0), eos_token_ids=(1, 106))
    hf = Gemma3TextConfig(**cfg.to_hf_dict())
    assert tuple(hf.layer_types) == cfg.layer_types
    assert hf.rope_parameters[FULL]["rope_theta"] == cfg.rope_theta
    assert hf.rope_parameters[FULL]["factor"] == 8.0
    assert hf.rope_parameters[SLIDING]["rope_theta"] == cfg.rope_local_base_freq
    assert (hf.sliding_window, hf.query_pre_attn_scalar, hf.head_dim) == (8, 16, 16)
    assert hf.eos_token_id == [1, 106]
    assert Gemma3Config.from_hf_dict(hf.to_dict()) == cfg


def test_from_hf_dict_reads_the_pre_v5_layout():
    legacy = {
        "model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 2560, "intermediate_size": 10240,
        "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "sliding_window": 1024, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
        "max_position_embeddings": 131072, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "eos_token_id": [1, 106],
    }
    cfg = Gemma3Config.from_hf_dict({"model_type": "gemma3", "text_config": legacy})
    assert cfg.full_layer_ids == (5, 11, 17, 23, 29)
    assert cfg.rope_scaling == RopeScaling("linear", 8.0)
    assert (cfg.rope_factor(5), cfg.rope_factor(4)) == (8.0, 1.0)
    assert cfg.eos_token_ids == (1, 106)
    # transformers agrees on the layer types it derives from the same legacy dict
    assert tuple(Gemma3TextConfig(**{k: v for k, v in legacy.items() if k != "model_type"}).layer_types) == (
        cfg.layer_types
    )


def test_unknown_rope_scaling_is_refused():
    with pytest.raises(NotImplementedError, match="yarn"):
        RopeScaling("yarn", 4.0)
