"""The AMX extend route (runtime/attention/amx_extend.py) inside the engine, on the real Gemma 3 270M in bfloat16.

The route runs where the CPU has AMX and the kernels' own tiles do not run on it; forced on here, it runs on any
CPU (torch's attention works everywhere, only slower), so CI covers the call site whatever machine it lands on. A chunked prefill of a prompt past the window, a
shorter one and a short one (fewer than `MIN_EXTEND` new tokens: the kernel's, in a call of its own) must give the
prefill logits of the kernel route, which tests/kernels checks against plain softmax attention."""

import pytest
import torch

from runtime import kernels
from runtime.attention import amx_extend
from runtime.config import EngineConfig
from runtime.core import SamplingParams
from runtime.engine import Engine
from runtime.models.loader import build_model
from runtime.models.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

PASSAGE = (
    "The ferry left the harbour twice a day, in the grey of the morning and again when the lamps along the quay "
    "were lit. Its captain kept a ledger of passengers, cargo and the state of the sea, and the islanders said "
    "that he had never once been late. "
)
# bfloat16 activations through 18 layers: the two attention paths round differently (torch's probabilities in
# bfloat16 blocks, the kernel's in its tiles), and single logits then move by units (either path against float32:
# up to 3.3 here), but the distributions agree (KL divergences of 1e-4 and under against float32); a wrong mask or a
# misplaced row moves them far more.
KL_TOLERANCE = 0.005


def _prefill_logits(engine: Engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    logits: list = []
    engine.generate(prompts, SamplingParams(max_new_tokens=1, ignore_eos=True), logits_out=logits)
    return [rows[0].float() for rows in logits]


def test_the_route_forced_on_gives_the_kernel_routes_prefill_logits(our_gguf_f32, gemma3_gguf_path, monkeypatch,
                                                                    request):
    if kernels.load() is None:
        pytest.skip(f"the fused CPU kernels are unavailable: {kernels.failure()}")
    config, state = our_gguf_f32
    tokenizer = load_tokenizer(gemma3_gguf_path)
    text = tokenizer.encode(PASSAGE * 16)
    prompts = [text[:700], text[60:360], text[120:160]]  # past the 512-token window; shorter; 24 + 16 new tokens
    assert len(prompts[0]) > config.sliding_window + amx_extend.MIN_EXTEND
    cfg = EngineConfig(model="gemma3-270m", dtype="bfloat16", quantization="none", max_total_tokens=4096,
                       chunked_prefill_size=1024, disable_prefix_caching=True)
    engine = Engine(cfg, model=build_model(config, state, torch.bfloat16), tokenizer=tokenizer)

    K = kernels.load()
    if K.extend_tiles() == "amx":  # the kernel's tiles on AVX512-BF16 (or AVX2) in both runs
        K.set_extend_tiles("bfloat16")
    request.addfinalizer(lambda: K.set_extend_tiles("auto"))
    monkeypatch.setattr(amx_extend, "CPU_HAS_AMX", False)
    kernel_route = _prefill_logits(engine, prompts)

    extends: list[list[int]] = []
    attend = amx_extend.extend_attention

    def spy(q, k_buf, v_buf, keys, qo, *rest):
        extends.append([b - a for a, b in zip(qo, qo[1:])])
        return attend(q, k_buf, v_buf, keys, qo, *rest)

    monkeypatch.setattr(amx_extend, "CPU_HAS_AMX", True)
    monkeypatch.setattr(amx_extend, "extend_attention", spy)
    routed = _prefill_logits(engine, prompts)

    assert [700, 300, 24] in extends  # the first chunk went through the route, its short request split off
    for want, got in zip(kernel_route[:2], routed[:2]):
        kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                        reduction="sum").item()
        print(f"KL(kernel route || AMX route) {kl:.2e}")
        assert got.argmax() == want.argmax()
        assert kl < KL_TOLERANCE
    assert torch.equal(routed[2], kernel_route[2])  # the short prompt: the kernel's in both runs, row for row


@pytest.mark.parametrize("kind", ["amx", "bfloat16", "float32"])
def test_each_kind_of_the_kernels_tiles_gives_the_token_at_a_time_prefill_logits(our_gguf_f32, gemma3_gguf_path,
                                                                                   kind, request, monkeypatch):
    """The kernels' extend tiles (on AMX-BF16, AVX512-BF16 or AVX2 in float32, each where this CPU runs it) give the
    prefill logits of their token-at-a-time path, up to the order of float32 sums and bfloat16 roundings, whole
    chunks and short ones. The torch route on AMX stays out (it would take the long prompts off the kernels)."""
    monkeypatch.setattr(amx_extend, "CPU_HAS_AMX", False)
    K = kernels.load()
    if K is None:
        pytest.skip(f"the fused CPU kernels are unavailable: {kernels.failure()}")
    try:
        K.set_extend_tiles(kind)
    except RuntimeError as exc:
        pytest.skip(str(exc))
    request.addfinalizer(lambda: K.set_extend_tiles("auto"))
    config, state = our_gguf_f32
    tokenizer = load_tokenizer(gemma3_gguf_path)
    text = tokenizer.encode(PASSAGE * 16)
    prompts = [text[:700], text[60:360], text[120:160]]
    cfg = EngineConfig(model="gemma3-270m", dtype="bfloat16", quantization="none", max_total_tokens=4096,
                       chunked_prefill_size=1024, disable_prefix_caching=True)
    engine = Engine(cfg, model=build_model(config, state, torch.bfloat16), tokenizer=tokenizer)
    in_tiles = _prefill_logits(engine, prompts)
    K.set_extend_tiles("none")
    token_at_a_time = _prefill_logits(engine, prompts)
    for want, got in zip(token_at_a_time, in_tiles):
        kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                        reduction="sum").item()
        print(f"KL(a token at a time || {kind} tiles) {kl:.2e}")
        assert got.argmax() == want.argmax()
        assert kl < KL_TOLERANCE
