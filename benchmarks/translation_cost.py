"""Cost of the translation cache, measured side by side in one run.

Prints (1) the hit-path cost of a memo lookup next to a prometheus_client Counter.inc() and a plain gather
through the mapping, and (2) gathers per forward for each policy on Gemma 3 270M's schedule of 15 sliding
layers (memo: one per distinct location tensor per forward; off: one per sliding layer).

    python benchmarks/translation_cost.py [--batch 8] [--repeat 20000]
"""

from __future__ import annotations

import argparse
import timeit

import torch
from prometheus_client import CollectorRegistry, Counter

from runtime.mem_cache.swa_pool import build_hybrid_kv_pool
from telemetry.logging import EventReporter
from telemetry.ratelimit import RateLimiter
from telemetry.stats import EngineStats

SLIDING_LAYERS = 15  # Gemma 3 270M: 18 layers, every sixth full
LAYERS = [(i + 1) % 6 != 0 for i in range(18)]


def make_pool(policy: str):
    stats = EngineStats(policy)
    pool = build_hybrid_kv_pool(
        full_size=4096, swa_size=1024, page_size=1, layer_is_swa=LAYERS, num_kv_heads=1, head_dim=8,
        dtype=torch.float32, policy=policy, stats=stats.translation, reporter=EventReporter(stats, RateLimiter(60.0)),
    )
    return pool, stats


def per_call_ns(fn, repeat: int) -> float:
    fn()
    best = min(timeit.repeat(fn, number=repeat, repeat=5))
    return best / repeat * 1e9


def hit_path(batch: int, repeat: int) -> None:
    pool, _ = make_pool("memo")
    loc = pool.allocator.alloc(batch)
    mapping = pool.allocator.full_to_swa_index_mapping
    counter = Counter("bench_total", "benchmark counter", registry=CollectorRegistry())
    pool.begin_forward(1, "eager_decode")
    pool.translate_loc_from_full_to_swa(loc, "kv_write")  # fill
    lookup = per_call_ns(lambda: pool.translate_loc_from_full_to_swa(loc, "kv_write"), repeat)
    pool.end_forward()
    inc = per_call_ns(counter.inc, repeat)
    gather = per_call_ns(lambda: mapping[loc].to(torch.int32), repeat)
    print(f"hit-path cost (batch {batch}, ns per call, best of 5 x {repeat}):")
    print(f"  memo lookup (hit)          {lookup:8.0f}")
    print(f"  prometheus Counter.inc()   {inc:8.0f}   lookup / inc    = {lookup / inc:5.2f}")
    print(f"  plain gather + int32 cast  {gather:8.0f}   lookup / gather = {lookup / gather:5.2f}")


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
    args = parser.parse_args()
    torch.set_num_threads(1)
    hit_path(args.batch, args.repeat)
    gathers_per_forward(args.batch)


if __name__ == "__main__":
    main()
