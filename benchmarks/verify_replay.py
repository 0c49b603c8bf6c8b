"""Cost of a speculative verify forward replayed over static buffers against the same forward run eagerly.

Two engines over one model, one with graphs (the verify forward replays over the buffers of its batch size and
K) and one without (eager), each holding the same requests prefilled. A round runs one verify forward in
each, in alternating order, over the same tokens and slots (each request's last token and its draft, written
again every round), so that machine noise falls on both alike. Shapes per batch size: every request drafting
K tokens (the buffers filled exactly) and drafts of mixed lengths (a padded tail). Prints the median forward
per branch, its spread (min-max and the middle 80%), and the median of the per-round ratios.

    python benchmarks/verify_replay.py [--model gemma3-270m] [--dtype bfloat16] [--quantization int8-head]
                                       [--batches 1 8] [-k 4] [--prompt 256] [--rounds 12] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from runtime.config import EngineConfig
from runtime.diagnose.driver import Driver
from runtime.engine import Engine
from runtime.executor.forward_batch import ForwardBatch
from runtime.models.loader import load_model
from runtime.models.tokenizer import load_tokenizer


def verify_batch(seqs, draft_lens: list[int], hi: int, gen: torch.Generator) -> ForwardBatch:
    """Each seq's last token and a random draft (token ids below `hi`) over its reserved slots (the same slots
    every round)."""
    prefix = [len(s.locs) for s in seqs]
    lens = [1 + n for n in draft_lens]
    ids = [t for s, n in zip(seqs, draft_lens)
           for t in [(s.ids + s.out)[-1], *torch.randint(4, hi, (n,), generator=gen).tolist()]]
    return ForwardBatch(is_decode=False, verify=True, input_ids=torch.tensor(ids),
                        positions=torch.tensor([p + i for p, n in zip(prefix, lens) for i in range(n)]),
                        out_cache_loc=torch.tensor([loc for s, n in zip(seqs, lens) for loc in s.reserved[:n]]),
                        req_rows=[s.row for s in seqs], prefix_lens=prefix,
                        seq_lens=[p + n for p, n in zip(prefix, lens)])


def spread(xs: list[float]) -> str:
    xs = sorted(xs)
    lo, hi = xs[len(xs) // 10], xs[-1 - len(xs) // 10]
    return f"{statistics.median(xs) * 1e3:7.2f} ms (min {xs[0] * 1e3:.2f}, 80% {lo * 1e3:.2f}-{hi * 1e3:.2f}, " \
           f"max {xs[-1] * 1e3:.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="int8-head")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("-k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    _, model = load_model(args.model, dtype=getattr(torch, args.dtype), quantization=args.quantization,
                          progress=False)
    tokenizer = load_tokenizer(args.model)
    gen = torch.Generator().manual_seed(0)
    hi = min(model.config.vocab_size, 30000)
    print(f"{args.model} {args.dtype} {args.quantization}, K = {args.k}, prompts of {args.prompt} tokens, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds")
    for bs in args.batches:
        prompts = [torch.randint(4, hi, (args.prompt,), generator=gen).tolist() for _ in range(bs)]
        engines = {}
        for branch, graphs in (("verify_replay", True), ("eager_verify", False)):
            cfg = EngineConfig(model=args.model, dtype=args.dtype, quantization=args.quantization, graphs=graphs,
                               graph_batch_sizes=(1, 2, 4, 8), max_running_requests=max(8, bs),
                               speculative_algorithm="ngram", num_speculative_tokens=args.k,
                               max_total_tokens=max(4096, bs * (args.prompt + 64)), swa_full_tokens_ratio=1.0,
                               chunked_prefill_size=bs * args.prompt)
            engine = Engine(cfg, progress=False, model=model, tokenizer=tokenizer)
            drive = Driver(engine, seed=0)
            seqs = drive.admit(prompts)
            drive.reserve(seqs, [args.k + 1] * bs)
            engines[branch] = (engine, seqs)
        mixed = [(i % (args.k + 1)) for i in range(bs)] if bs > 1 else [args.k // 2]
        for shape, lens in (("exact", [args.k] * bs), ("padded", mixed)):
            times = {b: [] for b in engines}
            for r in range(args.rounds + 2):  # two warm-up rounds
                order = list(engines) if r % 2 else list(reversed(engines))
                for branch in order:
                    engine, seqs = engines[branch]
                    batch = verify_batch(seqs, lens, hi, torch.Generator().manual_seed(r))
                    start = time.perf_counter()
                    engine.runner.forward(batch)
                    if r >= 2:
                        times[branch].append(time.perf_counter() - start)
            for branch, (engine, _) in engines.items():  # each engine ran its branch only
                assert engine.runner.branch_counts[branch] > 0 and sum(
                    engine.runner.branch_counts[b] for b in ("verify_replay", "eager_verify") if b != branch) == 0
            ratios = sorted(a / b for a, b in zip(times["verify_replay"], times["eager_verify"]))
            print(f"batch {bs}, drafts {lens} ({shape}): {sum(lens) + bs} live tokens")
            for branch, ts in times.items():
                print(f"  {branch:13s} {spread(ts)}")
            print(f"  replay / eager: median {statistics.median(ratios):.3f} "
                  f"(min {ratios[0]:.3f}, max {ratios[-1]:.3f})")


if __name__ == "__main__":
    main()
