"""The whole engine on a GPU at Gemma 3 270M's shapes: decode step time by batch size and attention backend.

Random weights in the real model's shapes (the GGUF is too large to carry to a lent GPU machine), bfloat16,
600-token prompts, 64 new tokens, greedy. Prints per backend and batch size the prefill time, the mean decode
step and tokens/s. On a GPU the runner replays decode over static buffers but does not capture CUDA graphs
yet, so a step is as slow as its kernel launches: this measures how slow.

    python benchmarks/gpu_engine.py [--device cuda] [--layers 18] [--batch-sizes 1,8,32]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from runtime.config import EngineConfig
from runtime.core import SamplingParams
from runtime.engine import Engine
from runtime.models.config import Gemma3Config, pattern_layer_types
from runtime.models.loader import build_model, random_state_dict
from runtime.models.tokenizer import ByteTokenizer


def gemma3_270m_shapes(layers: int) -> Gemma3Config:
    return Gemma3Config(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                        layer_types=pattern_layer_types(layers), query_pre_attn_scalar=256,
                        max_position_embeddings=32768)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def profile(engine: Engine, prompts: list[list[int]], gen_len: int) -> None:
    """Where a decode run's time goes: host functions by own time, then torch operators by host time."""
    import cProfile
    import pstats

    params = SamplingParams(max_new_tokens=gen_len, ignore_eos=True)
    prof = cProfile.Profile()
    prof.runcall(engine.generate, prompts, params)
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as tp:
        engine.generate(prompts, params)
    print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=600)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--profile", action="store_true",
                    help="profile the first batch size's decode run (host functions and torch operators)")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    config = gemma3_270m_shapes(args.layers)
    state = random_state_dict(config, seed=0, lively=False)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    gen = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name() if args.device.startswith('cuda') else args.device}  "
          f"torch {torch.__version__}  {args.layers} layers  prompts {args.prompt_len}  new {args.gen_len}")
    print(f"{'backend':8s} {'batch':>5s} {'prefill ms':>10s} {'step ms':>8s} {'tok/s':>8s}")
    for backend in ("torch", "triton"):
        cfg = EngineConfig(model="random-270m-shapes", dtype="bfloat16", quantization="none", device=args.device,
                           attention_backend=backend, max_running_requests=max(batches),
                           max_total_tokens=max(batches) * (args.prompt_len + args.gen_len + 64) + 4096,
                           disable_prefix_caching=True)
        model = build_model(config, state, torch.bfloat16, device=args.device)
        engine = Engine(cfg, model=model, tokenizer=ByteTokenizer())
        for b in batches:
            prompts = [torch.randint(4, 260, (args.prompt_len,), generator=gen).tolist() for _ in range(b)]
            one = SamplingParams(max_new_tokens=1, ignore_eos=True)
            engine.generate(prompts, one)  # warm-up: first-use compilation and allocations
            sync(args.device)
            t0 = time.perf_counter()
            engine.generate(prompts, one)
            sync(args.device)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            engine.generate(prompts, SamplingParams(max_new_tokens=args.gen_len, ignore_eos=True))
            sync(args.device)
            total = time.perf_counter() - t0
            step = (total - prefill) / (args.gen_len - 1)
            print(f"{backend:8s} {b:5d} {prefill * 1e3:10.1f} {step * 1e3:8.2f} {b * args.gen_len / total:8.0f}")
            if args.profile and b == batches[0]:
                profile(engine, prompts, args.gen_len)
        del engine, model
    return 0


if __name__ == "__main__":
    sys.exit(main())
