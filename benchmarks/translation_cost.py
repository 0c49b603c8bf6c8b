"""Cost of the translation cache, measured side by side in one run.

Prints (1) the hit-path cost of a memo lookup under each guard setting (off: `--loc-cache-guard off`, whose
hit takes the same guarded fast path and differs only in returning a stale entry instead of recomputing it;
on: the default guard of versions, identity, contents and the end-of-forward mapping check; strict:
`--loc-cache-verify 1`, every hit recomputed), the original key-only memo (emulated), a prometheus_client
Counter.inc() and a plain gather through the mapping; (2) what each setting costs per decode forward on
Gemma 3 270M's schedule of 15 sliding layers with the pool size of the engine it is held against, next to
that engine's decode step (`--model`: default Gemma 3 270M, the default model, so the percentage is of a
real decode step; `--model tiny` only to try the script quickly: its step is far shorter than any real
model's); (3) gathers per forward per policy.

    python benchmarks/translation_cost.py [--batch 8] [--repeat 20000] [--model gemma3-270m]
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch
from prometheus_client import CollectorRegistry, Counter

from runtime.mem_cache.swa_pool import build_hybrid_kv_pool
from telemetry.logging import EventReporter
from telemetry.ratelimit import RateLimiter
from telemetry.stats import EngineStats

SLIDING_LAYERS = 15  # Gemma 3 270M: 18 layers, every sixth full
LAYERS = [(i + 1) % 6 != 0 for i in range(18)]


GUARDS = {"off": dict(guard=False), "on (default)": dict(guard=True), "strict": dict(guard=True, verify_rate=1.0)}


def make_pool(policy: str, full_size: int = 4096, **options):
    stats = EngineStats(policy)
    pool = build_hybrid_kv_pool(
        full_size=full_size, swa_size=full_size // 4, page_size=1, layer_is_swa=LAYERS, num_kv_heads=1,
        head_dim=8, dtype=torch.float32, policy=policy, stats=stats.translation,
        reporter=EventReporter(stats, RateLimiter(60.0)), **options,
    )
    return pool, stats


def per_call_ns(fn, repeat: int) -> float:
    fn()
    best = min(timeit.repeat(fn, number=repeat, repeat=5))
    return best / repeat * 1e9


def hit_path(batch: int, repeat: int) -> None:
    counter = Counter("bench_total", "benchmark counter", registry=CollectorRegistry())
    inc = per_call_ns(counter.inc, repeat)
    print(f"hit-path cost (batch {batch}, ns per call, best of 5 x {repeat}):")
    gather = None
    for name, options in GUARDS.items():
        pool, _ = make_pool("memo", **options)
        loc = pool.allocator.alloc(batch)
        mapping = pool.allocator.full_to_swa_index_mapping
        pool.begin_forward(1, "eager_decode")
        pool.translate_loc_from_full_to_swa(loc, "kv_write")  # fill
        lookup = per_call_ns(lambda: pool.translate_loc_from_full_to_swa(loc, "kv_write"), repeat)
        pool.end_forward()
        gather = gather or per_call_ns(lambda: mapping[loc].to(torch.int32), repeat)
        print(f"  memo hit, guard {name:<13}{lookup:8.0f}   / Counter.inc() = {lookup / inc:5.2f}"
              f"   / gather = {lookup / gather:5.2f}")
    # `--loc-cache-guard off` only changes what rule 5 returns: its hit takes the same guarded fast path. The
    # original design checked the key alone; emulated here, to show what the guard itself adds to a hit.
    pool, _ = make_pool("memo")
    loc = pool.allocator.alloc(batch)
    value = pool.allocator.full_to_swa_index_mapping[loc].to(torch.int32)
    entry = {"key": (loc.data_ptr(), loc.numel()), "value": value}

    def key_only(loc=loc, entry=entry):
        return entry["value"] if entry["key"] == (loc.data_ptr(), loc.numel()) else None

    bare = per_call_ns(key_only, repeat)
    print(f"  key-only memo (emulated)      {bare:8.0f}   / Counter.inc() = {bare / inc:5.2f}"
          f"   / gather = {bare / gather:5.2f}")
    print(f"  prometheus Counter.inc()      {inc:8.0f}")
    print(f"  plain gather + int32 cast     {gather:8.0f}")


def per_forward_cost(batch: int, full_size: int, forwards: int = 2000) -> dict[str, float]:
    """Microseconds per decode forward spent translating: entry, 15 sliding-layer lookups, end of forward."""
    out = {}
    settings = {f"memo, guard {name}": ("memo", options) for name, options in GUARDS.items()}
    settings["off (15 gathers)"] = ("off", {})
    for name, (policy, options) in settings.items():
        pool, _ = make_pool(policy, full_size, **options)
        loc = pool.allocator.alloc(batch)

        def one_forward(f=[0]):
            f[0] += 1
            pool.begin_forward(f[0], "eager_decode")
            for layer in range(SLIDING_LAYERS):
                pool.translate_loc_from_full_to_swa(loc, "kv_write", layer)
            pool.end_forward()

        one_forward()
        out[name] = min(timeit.repeat(one_forward, number=forwards, repeat=5)) / forwards * 1e6
    return out


def decode_step_ms(model: str, batch: int, steps: int = 24) -> tuple[float, int]:
    """Median decode forward of a real engine at `batch` requests (64-token prompts), default settings; and
    its full pool size (the mapping the end-of-forward check compares)."""
    from runtime.config import EngineConfig
    from runtime.core import SamplingParams
    from runtime.engine import Engine

    times: list[float] = []

    class Watch:
        def after_step(self, batch_, seconds):
            if batch_.is_decode:
                times.append(seconds)

    engine = Engine(EngineConfig(model=model), progress=False, observer=Watch())
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 200, (64,), generator=gen).tolist() for _ in range(batch)]
    engine.generate(prompts, SamplingParams(max_new_tokens=steps, ignore_eos=True))
    return statistics.median(times[2:]) * 1e3, engine.resolved.full_pool_size


def step_overhead(batch: int, model: str) -> None:
    start = time.perf_counter()
    step, full_size = decode_step_ms(model, batch)
    costs = per_forward_cost(batch, full_size)
    print(f"\nper decode forward (batch {batch}, {SLIDING_LAYERS} sliding layers, mapping of {full_size} slots), "
          f"next to a {model} decode step of {step:.2f} ms (median, default engine, "
          f"{torch.get_num_threads()} torch thread(s)):")
    for name, us in costs.items():
        print(f"  {name:<24}{us:8.1f} us   {us / 1e3 / step * 100:6.3f}% of the step")
    print(f"  (measured in {time.perf_counter() - start:.0f} s; best of 5 x 2000 forwards per setting)")


def gathers_per_forward(batch: int, forwards: int = 10) -> None:
    print(f"\ngathers per forward on a {SLIDING_LAYERS}-sliding-layer schedule ({forwards} decode forwards):")
    print(f"  {'policy':<12}{'gathers/fwd':>12}{'hits/fwd':>10}{'misses/fwd':>12}{'events':>8}")
    for policy in ("memo", "layerwise", "per_forward", "off"):
        pool, stats = make_pool(policy)
        loc = pool.allocator.alloc(batch)
        k = torch.zeros(batch, 1, 8)
        t = stats.translation
        for f in range(1, forwards + 1):
            pool.begin_forward(f, "eager_decode")  # invalidates at forward entry
            swa_loc = pool.translate_loc_from_full_to_swa(loc, "attn_metadata") if policy == "per_forward" else None
            for layer in range(len(LAYERS)):
                pool.set_kv_buffer(layer, loc, k, k, swa_loc=swa_loc)
            pool.end_forward()
        hits, misses = sum(t.hit_counts.values()), sum(t.miss_counts.values())
        events = sum(t.key_change_counts.values())
        print(f"  {policy:<12}{t.translation_count / forwards:>12.1f}{hits / forwards:>10.1f}{misses / forwards:>12.1f}{events:>8}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=20000)
    parser.add_argument("--model", default="gemma3-270m",
                        help="engine whose decode step the costs are held against (default: the default model)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hit_path(args.batch, args.repeat)
    step_overhead(args.batch, args.model)
    gathers_per_forward(args.batch)


if __name__ == "__main__":
    main()
