"""Time to first token of a multi-turn chat with the prefix cache on and off, measured side by side in one run.

Each turn resends the conversation so far plus a new user message, as a chat client does; conversations are
served one request at a time, round-robin, so that the cache holds several of them at once. Two engines (cache
on, `--disable-prefix-caching`) run the same workload alternately, on/off then off/on (ABBA), each repetition
from a cold cache, so that a slow drift of a shared machine biases neither side. Printed per turn: TTFT median
and range over conversations and repetitions for each engine, and their ratio; then the later turns together,
the prefix-cache hit rate, and whether the outputs are token-identical. Nothing is asserted on time.

    python benchmarks/prefix_cache_chat.py                 # gemma3-270m on this machine
    python benchmarks/prefix_cache_chat.py --model tiny --first 64 --user 16 --answer 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `runtime` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.config import EngineConfig  # noqa: E402
from runtime.core import Req, SamplingParams  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.models.loader import load_model  # noqa: E402
from runtime.models.tokenizer import load_tokenizer  # noqa: E402

FIRST_REGULAR_ID = 4  # ids 0..3 are pad, eos, bos, unk


def run_chats(engine: Engine, args, seed: int) -> tuple[dict[int, list[float]], list[list[int]]]:
    """The whole workload on one engine: TTFT per turn (seconds, one per conversation) and every answer."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    tokens = lambda n: torch.randint(FIRST_REGULAR_ID, vocab, (n,), generator=gen).tolist()  # noqa: E731
    history = [tokens(args.first) for _ in range(args.chats)]
    params = SamplingParams(max_new_tokens=args.answer, ignore_eos=True)
    ttft: dict[int, list[float]] = {t: [] for t in range(args.turns)}
    answers = []
    for turn in range(args.turns):
        for c in range(args.chats):
            req = Req(list(history[c]), params)
            engine.scheduler.add(req)
            while not req.done:
                engine.step()
            ttft[turn].append(req.first_token_time - req.arrival_time)
            answers.append(req.output_ids)
            history[c] = history[c] + req.output_ids + tokens(args.user)
    return ttft, answers


def spread(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:8.1f} ms [{min(values) * 1e3:7.1f}, {max(values) * 1e3:7.1f}]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--chats", type=int, default=3)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first", type=int, default=384, help="tokens of each conversation's first message")
    p.add_argument("--user", type=int, default=64, help="tokens of each later user message")
    p.add_argument("--answer", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--reps", type=int, default=2, help="repetitions per engine, alternated ABBA")
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    _, model = load_model(args.model, device=args.device, progress=False)
    tokenizer = load_tokenizer(args.model)
    base = EngineConfig(model=args.model, device=args.device, max_total_tokens=args.max_total_tokens,
                        swa_full_tokens_ratio=0.25, max_running_requests=4)
    engines = {name: Engine(base.with_(disable_prefix_caching=name == "off"), progress=False, model=model,
                            tokenizer=tokenizer) for name in ("on", "off")}
    window = model.config.sliding_window
    longest = args.first + (args.turns - 1) * (args.answer + args.user)
    print(f"model {args.model} on {args.device}, window {window}; {args.chats} chats x {args.turns} turns, "
          f"prompts {args.first}..{longest} tokens, {args.answer} new per turn; {args.reps} reps per engine (ABBA)",
          flush=True)

    warmup = argparse.Namespace(**{**vars(args), "chats": 1, "turns": 2})
    for engine in engines.values():  # allocator, kernels; measured runs then start from a cold cache
        run_chats(engine, warmup, seed=999)
    ttft = {name: {t: [] for t in range(args.turns)} for name in engines}
    answers = {name: [] for name in engines}
    for rep in range(args.reps):
        for name in (("on", "off") if rep % 2 == 0 else ("off", "on")):
            engines[name].slots.clear_prefix_cache()
            times, out = run_chats(engines[name], args, seed=rep)
            per_turn = " ".join(f"{statistics.median(times[t]) * 1e3:.0f}" for t in range(args.turns))
            print(f"  rep {rep + 1}, cache {name}: median TTFT per turn (ms) {per_turn}", flush=True)
            for t, values in times.items():
                ttft[name][t] += values
            answers[name] += out

    print(f"\n{'turn':>4}  {'TTFT cache off: median [min, max]':>36}  {'TTFT cache on':>36}  on/off")
    for t in range(args.turns):
        off, on = ttft["off"][t], ttft["on"][t]
        print(f"{t + 1:>4}  {spread(off):>36}  {spread(on):>36}  {statistics.median(on) / statistics.median(off):6.2f}")
    later_off = [v for t in range(1, args.turns) for v in ttft["off"][t]]
    later_on = [v for t in range(1, args.turns) for v in ttft["on"][t]]
    if later_on:
        print(f"{'2..':>4}  {spread(later_off):>36}  {spread(later_on):>36}  "
              f"{statistics.median(later_on) / statistics.median(later_off):6.2f}")
    pc = engines["on"].stats.prefix_cache
    print(f"\nprefix-cache hit rate (tokens): {pc.hit_tokens / max(pc.queried_tokens, 1):.1%} "
          f"({pc.hit_tokens} of {pc.queried_tokens}, warm-up included)")
    same = answers["on"] == answers["off"]
    print(f"outputs token-identical with the cache on and off: {'yes' if same else 'NO'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
