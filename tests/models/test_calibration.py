"""Calibration of the prefill path's copies (`runtime/models/calibration.py`) on the tiny model in bfloat16 with
`int8-head`: one forward over the calibration text measures each eligible projection's input columns, and its
tiles' copy is the smoothed int8 copy those maxima give; the engine does it at start-up for `--prefill-weights
int8-128` and releases the kept values for `gguf`."""

import dataclasses

import pytest
import torch

from runtime import kernels
from runtime.config import EngineConfig
from runtime.core import SamplingParams
from runtime.engine import Engine
from runtime.layers import decode_linear
from runtime.layers.decode_linear import DecodeLinear
from runtime.layers.int4 import EVERY_ROW, OUR_MAX_ROWS
from runtime.models import calibration
from runtime.models.config import Gemma3Config
from runtime.models.loader import build_model, random_state_dict
from runtime.models.tokenizer import ByteTokenizer

# hidden 128: qkv and gate/up (128 values a row) and down (256) divide into blocks of 128; o (4 heads of 16) does not
CONFIG = dataclasses.replace(Gemma3Config.tiny(), hidden_size=128, intermediate_size=256)
STATE = random_state_dict(CONFIG, seed=0)
ELIGIBLE = ("qkv_proj", "gate_up_proj", "down_proj")


@pytest.fixture(autouse=True)
def vnni_without_amx():
    if not kernels.has_low_bit():
        pytest.skip("the tiles' copies are our kernels' (AVX512-VNNI or AVX2)")
    if OUR_MAX_ROWS < EVERY_ROW:
        pytest.skip("with AMX prefill keeps oneDNN's bfloat16 weight: no tiles' copies")


def model():
    return build_model(CONFIG, STATE, torch.bfloat16, quantization="int8-head")


def projections(m) -> dict[str, DecodeLinear]:
    return {name: mod for name, mod in m.named_modules() if isinstance(mod, DecodeLinear)}


def test_each_eligible_projection_gets_the_copy_its_measured_inputs_give():
    m = model()
    ids = calibration.calibration_ids(ByteTokenizer(), CONFIG.bos_token_id, CONFIG.max_position_embeddings)
    assert len(ids) == CONFIG.max_position_embeddings  # the byte ids run past the model's positions: cut there
    sources = {name: mod.tiles_source for name, mod in projections(m).items()}
    assert {n.rsplit(".", 1)[1] for n, s in sources.items() if s is not None} == set(ELIGIBLE)
    # the inputs each projection sees, measured here independently of the module under test
    seen: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(mod, args):
            seen[name] = args[0].float()  # returns None: the input goes on unchanged
        return hook

    hooks = [mod.register_forward_pre_hook(keep(name)) for name, mod in projections(m).items()]
    calibration.sequence_forward(m, ids)
    for h in hooks:
        h.remove()
    assert calibration.calibrate_prefill_weights(m, ids) == 3 * CONFIG.num_hidden_layers
    x = torch.randn(24, 256).bfloat16()
    for name, mod in projections(m).items():
        if sources[name] is None:
            assert not mod.decode.projection.has_tiles
            continue
        assert mod.tiles_source is None and mod.decode.projection.smoothed
        column_max = seen[name].abs().amax(0)
        s = decode_linear.smoothing(column_max, sources[name])
        expected = kernels.load().Projection.int8_wide(
            *decode_linear.quantize_per_block(sources[name] * s, 128, decode_linear.tile_pair_budget()), s)
        rows = x[:, :mod.in_features].contiguous()
        with torch.no_grad():
            assert torch.equal(mod(rows), expected.matmul(rows)), name
    assert calibration.calibrate_prefill_weights(m, ids) == 0  # made once


def test_calibration_refuses_too_few_tokens_and_keeps_what_it_had():
    m = model()
    with pytest.raises(ValueError, match="more than 8 tokens"):
        calibration.calibrate_prefill_weights(m, [2, 5, 6])
    assert all(mod.tiles_source is not None for n, mod in projections(m).items() if n.endswith(ELIGIBLE))
    assert not any(mod._forward_pre_hooks for mod in projections(m).values())


@pytest.mark.parametrize("choice", ["int8-128", "gguf"])
def test_the_engine_calibrates_at_start_or_releases_the_kept_values(choice):
    m = model()
    cfg = EngineConfig(model="tiny", dtype="bfloat16", quantization="int8-head", max_total_tokens=2048,
                       prefill_weights=choice)
    engine = Engine(cfg, progress=False, model=m, tokenizer=ByteTokenizer())
    assert all(mod.tiles_source is None for mod in projections(m).values())
    tiled = [n for n, mod in projections(m).items() if mod.decode.projection.has_tiles]
    assert len(tiled) == (3 * CONFIG.num_hidden_layers if choice == "int8-128" else 0)
    prompt = [CONFIG.bos_token_id] + [(7 * i) % 250 + 4 for i in range(40)]  # 41 rows: past eight, on the tiles
    out = engine.generate([prompt], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(out[0]) == 4
    engine.scheduler.assert_idle_clean()
