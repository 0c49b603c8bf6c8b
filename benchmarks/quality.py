"""What each dtype and weight format costs in quality, against transformers on the same weights, in one run.

For every variant of this runtime (float32, bfloat16, int8 weights with float32 or bfloat16 activations,
bfloat16 with an int8 LM head),
printed side by side with transformers in float32 and bfloat16:

1. Perplexity of a fixed English paragraph (teacher-forced, one forward over the whole text), and its
   change against our float32 run.
2. Top-1 agreement, teacher-forced: at each position of the text, is the greedy next token the same as
   transformers' in the same context? Against transformers in the variant's activation dtype (the same
   arithmetic, so only implementation differences and, for int8, the quantisation show) and in float32.
   Teacher forcing keeps one near-tie from cascading into a different continuation.
3. Free-running greedy generation through the engine (extend, decode, graph replay, KV pool in the dtype)
   from a few prompts cut from the text, against transformers' `generate` in the same activation dtype:
   tokens equal position by position, and how many leading tokens agree.

    python benchmarks/quality.py [--model gemma3-270m] [--new-tokens 32] [--prompts 4] [--prompt-len 48]
                                 [--prefill-weights int8-128|gguf]

Attention in (1) and (2) is a dense single-sequence backend (causal, windowed on sliding layers, in float32
as the runtime's torch backend computes it); the weights and the model's arithmetic are what is measured
there, the runtime's KV path is what (3) adds. A bfloat16 variant's prefill path is scored a second time
("runtime attention") with the attention the runtime runs for it: the fused kernels' extend attention, or
torch's on AMX tiles where the CPU has AMX (`runtime/attention/torch_native.py` `fused_extend`). int8 matmuls
take one of two paths by row count (see `runtime/layers/quantized.py`): a whole-text forward takes the prefill
path (weights dequantised to float32; an int8 LM head: the float weight); the decode path (the int8 kernel,
activations rounded to bfloat16; the int8 head on one position at a time) is scored too, on the same forward
under `kernel_path_only()`.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Plain English prose written for this measurement (no download): ordinary vocabulary and syntax, long
# enough to give a few hundred scored tokens.
REFERENCE_TEXT = (
    "On the morning the river flooded, the bakery on Mill Street opened an hour late. The owner, a tall woman "
    "who had run the shop for twenty years, walked down to the water before dawn to see how high it had "
    "risen. The footbridge was gone, and the field behind the school had turned into a brown lake with fence "
    "posts standing in it like the masts of sunken boats. She went back, lit the ovens, and made twice the "
    "usual number of loaves, because she knew that people who could not reach the supermarket across the "
    "river would come to her instead. By nine o'clock there was a queue outside the door. Some customers "
    "had waded through the water in their boots; others had borrowed a neighbour's canoe. Nobody complained "
    "about the wait. They talked about the weather, about the last great flood thirty years earlier, and "
    "about the farmer whose sheep had to be carried to the church on the hill. When the bread ran out at "
    "noon, the owner wrote a note on a piece of cardboard and taped it to the window: more at four, bring "
    "your own bags. In the afternoon the rain stopped, the sun came out over the hills, and children "
    "gathered at the edge of the flooded field to throw sticks into the current and watch them drift "
    "towards the town."
)

# (activation dtype, weight format) of each variant of this runtime
VARIANTS = (("float32", "none"), ("bfloat16", "none"), ("float32", "int8"), ("bfloat16", "int8"),
            ("bfloat16", "int8-head"))


# ---- teacher-forced scoring ------------------------------------------------------------------------------


class RuntimeAttention:
    """A forward-context backend for one sequence that attends as the runtime does a fresh prompt's extend: for a
    bfloat16 model on the fused kernels (or through torch's on AMX tiles), the keys read from k and v as from a
    pool; where the kernels do not serve (float32, none built), `SequenceAttention`'s dense float32."""

    def forward(self, q, k, v, layer):  # q (T, H, D), k/v (T, Hkv, D) -> (T, H, D)
        from runtime import kernels
        from runtime.attention.sliding_window import KVIndexList
        from runtime.attention.torch_native import fused_extend
        from runtime.models.calibration import SequenceAttention

        fused = kernels.for_tensor(q)
        if fused is None:
            return SequenceAttention().forward(q, k, v, layer)
        T = q.shape[0]
        slots = torch.arange(T, dtype=torch.int32)
        bounds = torch.tensor([0, T], dtype=torch.int32)
        keys = KVIndexList(indptr=bounds, indices=slots, start=bounds[:1], indptr_list=[0, T], start_list=[0])
        return fused_extend(fused, q, k.contiguous(), v.contiguous(), keys, [0, T], bounds, slots, [0], layer)


def model_logits(model, ids: list[int], decode_path: bool = False, runtime_attention: bool = False) -> torch.Tensor:
    """(T, vocab) float32 logits of this runtime's `model` at every position of `ids`, in one forward;
    `decode_path`: int8 matmuls through the kernel that decode uses, and the logits one position at a time
    (as a batch-1 decode step computes them: an int8 LM head quantises its input per call);
    `runtime_attention`: attention as the runtime runs it (`RuntimeAttention`), not dense float32."""
    from contextlib import nullcontext

    from runtime.layers.quantized import kernel_path_only
    from runtime.models.calibration import sequence_forward

    with torch.no_grad(), (kernel_path_only() if decode_path else nullcontext()):
        hidden = sequence_forward(model, ids, RuntimeAttention() if runtime_attention else None)
        if not decode_path:
            return model.compute_logits(hidden)
        return torch.cat([model.compute_logits(row) for row in hidden.split(1)])


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """(T, vocab) float32 logits of a transformers causal LM at every position of `ids`."""
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids], device=hf.device)).logits[0].float()


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of ids[1:] given the logits (T, vocab) at positions 0..T-2."""
    target = torch.tensor(ids[1:], device=logits.device)
    return math.exp(float(F.cross_entropy(logits[:-1].float(), target)))


def top1_agreement(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """Fraction of positions whose argmax (the greedy next token) is the same in both (T, vocab) tensors."""
    return float((logits.argmax(-1) == reference.argmax(-1)).float().mean())


# ---- free-running greedy ---------------------------------------------------------------------------------


@dataclass
class GreedyAgreement:
    equal_fraction: float  # tokens equal position by position, over all prompts
    mean_common_prefix: float  # leading tokens equal, averaged over prompts
    identical: int  # prompts whose whole continuation is equal


def greedy_agreement(ours: list[list[int]], theirs: list[list[int]]) -> GreedyAgreement:
    pairs = [(a, b) for o, t in zip(ours, theirs) for a, b in zip(o, t)]
    prefixes = []
    for o, t in zip(ours, theirs):
        n = next((i for i, (a, b) in enumerate(zip(o, t)) if a != b), min(len(o), len(t)))
        prefixes.append(n)
    return GreedyAgreement(sum(a == b for a, b in pairs) / len(pairs), sum(prefixes) / len(prefixes),
                           sum(o == t for o, t in zip(ours, theirs)))


def text_prompts(ids: list[int], count: int, length: int, bos: int) -> list[list[int]]:
    """`count` prompts of `length` ids (BOS + a slice of the text), starting at spread-out offsets."""
    body = ids[1:] if ids and ids[0] == bos else ids
    step = max((len(body) - length) // max(count, 1), 1)
    return [[bos] + body[i * step:i * step + length - 1] for i in range(count)]


def engine_greedy(model_name: str, model, tokenizer, dtype: str, quantization: str, prompts, new_tokens: int,
                  prefill_weights: str):
    from runtime.config import EngineConfig
    from runtime.core import SamplingParams
    from runtime.engine import Engine

    cfg = EngineConfig(model=model_name, dtype=dtype, quantization=quantization, max_total_tokens=4096,
                       swa_full_tokens_ratio=1.0, disable_prefix_caching=True, prefill_weights=prefill_weights)
    engine = Engine(cfg, progress=False, model=model, tokenizer=tokenizer)
    return engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))


# ---- entry point -----------------------------------------------------------------------------------------


def main() -> None:
    from runtime.config import PREFILL_WEIGHTS, EngineConfig

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill-weights", choices=PREFILL_WEIGHTS, default=EngineConfig().prefill_weights,
                    help="int8-head's rows past eight: int8 in blocks of 128 (the default) or the GGUF's blocks")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=48)
    args = ap.parse_args()

    from runtime.bench import load_transformers, run_transformers
    from runtime.models.calibration import prepare_prefill_weights
    from runtime.models.loader import build_model, read_weights
    from runtime.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    config, state = read_weights(args.model, torch.float32, progress=False)
    ids = [config.bos_token_id] + tokenizer.encode(REFERENCE_TEXT)
    prompts = text_prompts(ids, args.prompts, args.prompt_len, config.bos_token_id)

    hf32 = load_transformers(EngineConfig(model=args.model, dtype="float32", quantization="none"))
    hf = {"float32": hf32, "bfloat16": copy.deepcopy(hf32).to(torch.bfloat16)}
    ref_logits = {dt: hf_logits(m, ids) for dt, m in hf.items()}
    ref_greedy = {dt: run_transformers(m, prompts, args.new_tokens).outputs for dt, m in hf.items()}

    rows = []
    for dt, m in hf.items():
        rows.append((f"transformers {dt}", perplexity(ref_logits[dt], ids), top1_agreement(ref_logits[dt], ref_logits[dt]),
                     top1_agreement(ref_logits[dt], ref_logits["float32"]), None))
    base_ppl = None
    for dt, quant in VARIANTS:
        model = build_model(config, state, getattr(torch, dt), quantization=quant)
        prepare_prefill_weights(model, args.prefill_weights == "int8-128", tokenizer)
        greedy = greedy_agreement(engine_greedy(args.model, model, tokenizer, dt, quant, prompts, args.new_tokens,
                                                args.prefill_weights), ref_greedy[dt])
        paths = [(False, False, "")] if quant == "none" else [(False, False, ", prefill path"),
                                                              (True, False, ", decode path")]
        if dt == "bfloat16":
            paths.insert(1, (False, True, (", prefill path" if quant != "none" else "") + ", runtime attention"))
        for decode_path, runtime_attention, label in paths:
            logits = model_logits(model, ids, decode_path, runtime_attention)
            ppl = perplexity(logits, ids)
            base_ppl = base_ppl or ppl
            name = f"ours {dt}" + ("" if quant == "none" else f" + {quant} weights") + label
            rows.append((name, ppl, top1_agreement(logits, ref_logits[dt]),
                         top1_agreement(logits, ref_logits["float32"]),
                         greedy if decode_path or (quant == "none" and not runtime_attention) else None))
        del model

    print(f"model {args.model}; text: {len(ids)} tokens (teacher-forced); greedy: {len(prompts)} prompts of "
          f"{args.prompt_len} tokens, {args.new_tokens} new tokens each, against transformers' generate in the "
          "same activation dtype\n")
    header = (f"{'variant':<66} {'perplexity':>10} {'vs ours f32':>11} {'top-1 = HF same dtype':>21}"
              f" {'top-1 = HF f32':>14} {'greedy equal':>12} {'common prefix':>13} {'identical':>9}")
    print(header)
    for name, ppl, same, f32, greedy in rows:
        change = f"{(ppl / base_ppl - 1) * 100:+.2f}%"
        g = ("-", "-", "-") if greedy is None else (
            f"{greedy.equal_fraction:.1%}", f"{greedy.mean_common_prefix:.1f}", f"{greedy.identical}/{len(prompts)}")
        print(f"{name:<66} {ppl:>10.3f} {change:>11} {same:>21.1%} {f32:>14.1%} {g[0]:>12} {g[1]:>13} {g[2]:>9}")


if __name__ == "__main__":
    main()
