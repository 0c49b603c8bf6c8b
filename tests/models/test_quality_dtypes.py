"""bfloat16, int8 weights and an int8 LM head on the real Gemma 3 270M: perplexity within 2% of float32's and
greedy choices that agree with transformers, on the fixed English paragraph of `benchmarks/quality.py` (whose scoring
functions are the ones tested here, teacher-forced: every position scored in the same context). int8 is
scored on both of its paths: prefill (weights dequantised to float32) and decode (the int8 kernel,
activations rounded to bfloat16), the one that picks generated tokens. A bfloat16 variant's prefill is scored
again with the attention the runtime runs for it (`quality.RuntimeAttention`: the fused kernels', or torch's on
AMX), and what `--dtype auto --quantization auto` runs (bfloat16 with `int8-head`, or with `int8` on AVX2 without
FMA), prefill and decode as they run, must stay within 1% of float32: the bound `auto` promises.

Greedy agreement thresholds, per position of the text (261 scored positions):
- bfloat16 against transformers in bfloat16: >= 95%. Both compute in bfloat16 and differ only in the order
  of operations (fused projections, fused attention kernel, rotation in float32); transformers' own bfloat16
  run agrees with its float32 run on ~97% of positions here, so two bfloat16 implementations should differ
  by about as much (measured: 98.5%). 95% leaves room for a few near-ties, no more than 13 positions.
- int8 weights against transformers in float32: >= 90%. Per-channel int8 rounds each weight to 1/254 of its
  row's largest magnitude, a coarser step than bfloat16's 1/256 relative for most weights, and it compounds
  over 18 layers (measured: 94-95%). Perplexity, the tighter quality check, must still be within 2%.
- bfloat16 with an int8 LM head (`int8-head`, decode path: one position per call, as at batch 1) against
  transformers in bfloat16: >= 90%. Only the head is quantised, but its input too (8 bits, one scale per
  call), which moves near-ties between the top tokens (measured: 95.4%, against 98.5% without it).
"""

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from runtime.models.calibration import prepare_prefill_weights
from runtime.models.loader import build_model
from runtime.models.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

PPL_BOUND = 0.02
BF16_AGREEMENT = 0.95
INT8_AGREEMENT = 0.90


def _load_quality():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "quality.py"
    spec = importlib.util.spec_from_file_location("quality_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


quality = _load_quality()


@pytest.fixture(scope="module")
def text_ids(gemma3_gguf_path, our_gguf_f32):
    config, _ = our_gguf_f32
    return [config.bos_token_id] + load_tokenizer(gemma3_gguf_path).encode(quality.REFERENCE_TEXT)


@pytest.fixture(scope="module")
def reference(hf_gguf_model, text_ids):
    """transformers' logits over the text in float32 and in bfloat16."""
    hf16 = copy.deepcopy(hf_gguf_model).to(torch.bfloat16)
    return {"float32": quality.hf_logits(hf_gguf_model, text_ids), "bfloat16": quality.hf_logits(hf16, text_ids)}


@pytest.fixture(scope="module")
def ours(gemma3_gguf_path, our_gguf_f32, text_ids):
    """Our logits over the text, per (activation dtype, weight format, path), from the same float32 weights;
    path "decode" only for the int8 formats. The prefill path as the engine runs it by default: `int8-head`'s rows
    past eight on the smoothed int8 copies in blocks of 128 where the CPU takes them (`--prefill-weights`)."""
    config, state = our_gguf_f32
    tokenizer = load_tokenizer(gemma3_gguf_path)
    logits = {}
    for dt, q in quality.VARIANTS:
        model = build_model(config, state, getattr(torch, dt), quantization=q)
        prepare_prefill_weights(model, True, tokenizer)
        logits[(dt, q, "prefill")] = quality.model_logits(model, text_ids)
        if dt == "bfloat16":  # the attention the runtime runs for it: the fused kernels', or torch's on AMX
            logits[(dt, q, "runtime")] = quality.model_logits(model, text_ids, runtime_attention=True)
        if q != "none":
            logits[(dt, q, "decode")] = quality.model_logits(model, text_ids, decode_path=True)
    return logits


SCORED = ([(dt, q, "prefill") for dt, q in quality.VARIANTS]
          + [(dt, q, "decode") for dt, q in quality.VARIANTS if q != "none"]
          + [(dt, q, "runtime") for dt, q in quality.VARIANTS if dt == "bfloat16"])
# what `--dtype auto --quantization auto` runs: on AVX2 (with FMA and F16C) and bfloat16 CPUs; on AVX2 without them
AUTO_CHOICES = [("bfloat16", "int8-head"), ("bfloat16", "int8")]
AUTO_PPL_BOUND = 0.01  # the bound `auto` promises (runtime/auto_settings.py)


def test_the_text_is_long_enough_and_float32_is_exact(text_ids, ours, reference):
    assert len(text_ids) > 200
    assert quality.top1_agreement(ours[("float32", "none", "prefill")], reference["float32"]) == 1.0
    f32 = quality.perplexity(ours[("float32", "none", "prefill")], text_ids)
    assert f32 == pytest.approx(quality.perplexity(reference["float32"], text_ids), rel=1e-4)
    assert 5 < f32 < 100  # plain prose under a small pretrained model: not memorised, not noise


@pytest.mark.parametrize("variant", [v for v in SCORED if v[:2] != ("float32", "none")], ids="-".join)
def test_perplexity_within_two_percent_of_float32(variant, ours, text_ids):
    f32 = quality.perplexity(ours[("float32", "none", "prefill")], text_ids)
    ppl = quality.perplexity(ours[variant], text_ids)
    print(f"\n{variant}: perplexity {ppl:.3f} vs float32 {f32:.3f} ({(ppl / f32 - 1) * 100:+.2f}%)")
    assert abs(ppl / f32 - 1) <= PPL_BOUND


def test_bfloat16_greedy_choices_agree_with_transformers_in_bfloat16(ours, reference):
    agreement = quality.top1_agreement(ours[("bfloat16", "none", "prefill")], reference["bfloat16"])
    print(f"\nbfloat16 top-1 agreement with transformers bfloat16: {agreement:.1%}")
    assert agreement >= BF16_AGREEMENT


@pytest.mark.parametrize("path", ["prefill", "decode"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_greedy_choices_agree_with_transformers_in_float32(dtype, path, ours, reference):
    agreement = quality.top1_agreement(ours[(dtype, "int8", path)], reference["float32"])
    print(f"\nint8 weights, {dtype} activations, {path} path: top-1 agreement with transformers float32: "
          f"{agreement:.1%}")
    assert agreement >= INT8_AGREEMENT


def test_int8_head_greedy_choices_agree_with_transformers_in_bfloat16(ours, reference):
    agreement = quality.top1_agreement(ours[("bfloat16", "int8-head", "decode")], reference["bfloat16"])
    print(f"\nbfloat16 with an int8 LM head, decode path: top-1 agreement with transformers bfloat16: {agreement:.1%}")
    assert agreement >= INT8_AGREEMENT


@pytest.mark.parametrize("path", ["runtime", "decode"])
@pytest.mark.parametrize("choice", AUTO_CHOICES, ids="-".join)
def test_what_auto_runs_stays_within_one_percent_of_float32(choice, path, ours, text_ids):
    """`auto`'s choices as they run: prefill with the runtime's attention (the kernels', or torch's on AMX), and
    the decode path (its kernels; with int8-head the LM head screened)."""
    f32 = quality.perplexity(ours[("float32", "none", "prefill")], text_ids)
    ppl = quality.perplexity(ours[(*choice, path)], text_ids)
    print(f"\n{choice}, {path}: perplexity {ppl:.3f} vs float32 {f32:.3f} ({(ppl / f32 - 1) * 100:+.2f}%)")
    assert abs(ppl / f32 - 1) <= AUTO_PPL_BOUND
