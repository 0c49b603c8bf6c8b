"""Cost of the KV sanitizer per decode step, measured side by side in one run.

Three engines over one model (`--kv-sanitizer off`, `sampled`, `strict`), each decoding the same batch of
requests, step in lockstep: every round runs one decode step of each, in a rotating order, so that machine
noise falls on all three alike. A step is the whole `Engine.step()` (the scheduler's slot claims and the
allocator's ledger updates included, not only the forward). Prints the median step per setting and the ratio
to `off` (the median of the per-round ratios, with the interval of its middle 90% and the mean's 95%
confidence interval), so that a cost of 1% is resolved when the interval is narrower than that.

The difference of two noisy step times resolves a fraction of a percent only over very many rounds, so the
`sampled` engine also times its own sanitizer work directly: every call into the sanitizer, the ownership
ledger and the slot claims that feed it is wrapped in a stopwatch (outermost call only; the wrapper's own
cost counted too, so this overstates a little), and that time per step is printed as a share of the `off`
engine's median step.

    python benchmarks/sanitizer_cost.py [--model gemma3-270m] [--batch 8] [--prompt 256] [--rounds 64]

`--model tiny` tries the script quickly; its steps are far shorter than a real model's, so its percentages
overstate the cost.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from runtime.config import EngineConfig
from runtime.core import Req, SamplingParams
from runtime.engine import Engine
from runtime.models.loader import load_model
from runtime.models.tokenizer import load_tokenizer

MODES = ("off", "sampled", "strict")


def decoding_engine(cfg: EngineConfig, model, tokenizer, prompts: list[list[int]], steps: int) -> Engine:
    """An engine whose batch has finished prefill and has `steps` decode steps left for every request."""
    engine = Engine(cfg, progress=False, model=model, tokenizer=tokenizer)
    reqs = [Req(p, SamplingParams(max_new_tokens=steps + 2, ignore_eos=True)) for p in prompts]
    for r in reqs:
        engine.scheduler.add(r)
    while not all(r.output_ids for r in reqs):  # prefill (chunked), then every request has its first token
        engine.step()
    return engine


class Stopwatch:
    """Time spent inside wrapped methods, counting only the outermost of nested calls."""

    def __init__(self):
        self.seconds, self.calls, self._depth = 0.0, 0, 0

    def wrap(self, obj, name: str) -> None:
        method = getattr(obj, name)

        def timed(*args, **kwargs):
            if self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
                self._depth -= 1

        setattr(obj, name, timed)  # an instance attribute: only this engine's objects are timed

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def time_sanitizer_work(engine: Engine) -> Stopwatch:
    """Wrap every entry of the sanitizer's work in `engine`: its checks, the ledger's updates, the claims."""
    watch = Stopwatch()
    ledger = engine.pool.allocator.ledger
    for name in ("begin_forward", "end_forward", "bind", "check_write", "check_read", "check_host_copy"):
        watch.wrap(engine.pool.sanitizer, name)
    for name in ("begin_forward", "end_forward", "mapped", "remapped", "claim", "to_tree", "clear"):
        watch.wrap(ledger, name)
    for pool_ledger in (ledger.full, ledger.swa):
        for name in ("taken", "given_back"):
            watch.wrap(pool_ledger, name)
    for name in ("claim", "to_tree"):
        watch.wrap(engine.slots, name)
    return watch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--rounds", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    defaults = EngineConfig(model=args.model).concrete()  # the defaults on this CPU (--dtype/--quantization auto)
    cfg, model = load_model(args.model, dtype=getattr(torch, defaults.dtype), quantization=defaults.quantization,
                            progress=False)
    tokenizer = load_tokenizer(args.model)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, min(cfg.vocab_size, 30000), (args.prompt,), generator=gen).tolist()
               for _ in range(args.batch)]
    base = EngineConfig(model=args.model, max_running_requests=args.batch, graph_batch_sizes=(args.batch,),
                        kv_cache_memory=0.25)
    engines = {mode: decoding_engine(base.with_(kv_sanitizer=mode), model, tokenizer, prompts, args.rounds + 1)
               for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    watch = time_sanitizer_work(engines["sampled"])
    for mode in MODES:  # one untimed step each: first-step allocations out of the way
        engines[mode].step()
    watch.reset()
    for round_ in range(args.rounds):
        order = MODES[round_ % 3:] + MODES[:round_ % 3]
        for mode in order:
            start = time.perf_counter()
            engines[mode].step()
            times[mode].append(time.perf_counter() - start)
    off = times["off"]
    print(f"decode step, {args.model}, batch {args.batch}, prompts of {args.prompt} tokens, "
          f"{args.rounds} lockstep rounds")
    print(f"{'setting':<9}{'median ms':>10}{'ratio to off':>14}{'middle 90%':>20}{'mean, 95% CI':>22}")
    for mode in MODES:
        ratios = sorted(t / o for t, o in zip(times[mode], off))
        lo, hi = ratios[int(0.05 * len(ratios))], ratios[int(0.95 * len(ratios)) - 1]
        mean = statistics.fmean(ratios)
        half = 1.96 * statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else float("nan")
        print(f"{mode:<9}{statistics.median(times[mode]) * 1e3:10.2f}{statistics.median(ratios):14.4f}"
              f"{f'{lo:.3f} .. {hi:.3f}':>20}{f'{mean:.4f} +- {half:.4f}':>22}")
    per_step = watch.seconds / args.rounds
    print(f"sampled: its sanitizer work timed directly: {per_step * 1e6:.0f} us a step ({watch.calls / args.rounds:.1f} "
          f"calls), {100 * per_step / statistics.median(off):.3f}% of the median step with it off")
    for mode in MODES:
        counts = {k: v for k, v in engines[mode].stats.translation.key_change_counts.items()
                  if v and k[1] != "benign_fresh_tensor"}
        if counts:
            print(f"warning: {mode} counted events {counts}")


if __name__ == "__main__":
    main()
