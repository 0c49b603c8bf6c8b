"""KV pools sized from a memory budget: the SWA pool for the concurrency it serves, the full pool from the rest,
and a full batch of long requests that never thrashes (no retraction) on the default sizes."""

import pytest
import torch

from runtime.config import EngineConfig, PoolTooSmallError
from runtime.core import Req, SamplingParams
from runtime.mem_cache.hicache import HostKVCache
from runtime.mem_cache.slots import KVSlots
from runtime.mem_cache.swa_pool import build_hybrid_kv_pool
from runtime.models.config import Gemma3Config
from runtime.options import memory_gib
from runtime.scheduler.scheduler import Scheduler
from telemetry.stats import EngineStats

# Gemma 3 270M's shape: 18 layers (every sixth global), 1 KV head of 256, window 512, 32k context.
GEMMA_270M = Gemma3Config.tiny(num_hidden_layers=18, sliding_window_pattern=6, sliding_window=512,
                               max_position_embeddings=32768).with_(num_key_value_heads=1, head_dim=256,
                                                                    num_attention_heads=4)


def bytes_per_token(dtype_bytes: int) -> tuple[int, int]:
    per_layer = 2 * 1 * 256 * dtype_bytes  # K and V of one KV head of 256
    return 3 * per_layer, 15 * per_layer  # 3 global layers, 15 sliding


@pytest.mark.parametrize("dtype, element", [("float32", 4), ("bfloat16", 2)])
def test_the_budget_splits_into_a_swa_pool_for_the_running_batch_and_a_full_pool_for_the_rest(dtype, element):
    cfg = EngineConfig(dtype=dtype, kv_cache_memory=1.0, max_running_requests=16, chunked_prefill_size=2048)
    rc = cfg.resolve(GEMMA_270M)
    full_bytes, swa_bytes = bytes_per_token(element)
    assert rc.swa_pool_size == 16 * (512 + 1) + 2048
    assert rc.full_pool_size == (2**30 - rc.swa_pool_size * swa_bytes) // full_bytes
    assert rc.full_pool_size * full_bytes + rc.swa_pool_size * swa_bytes <= 2**30


def test_the_full_pool_never_exceeds_every_running_request_s_whole_context():
    rc = EngineConfig(kv_cache_memory=64.0, max_running_requests=2, context_length=1000).resolve(GEMMA_270M)
    assert rc.full_pool_size == 2 * 1000 + 2048


def test_pages_round_the_pools_and_hand_sizes_still_win():
    rc = EngineConfig(kv_cache_memory=1.0, page_size=16).resolve(GEMMA_270M)
    assert rc.full_pool_size % 16 == 0 and rc.swa_pool_size % 16 == 0
    manual = EngineConfig(max_total_tokens=8192, swa_full_tokens_ratio=0.5).resolve(GEMMA_270M)
    assert (manual.full_pool_size, manual.swa_pool_size) == (8192, 4096)


def test_a_budget_too_small_for_the_running_batch_is_refused_with_what_to_change():
    with pytest.raises(PoolTooSmallError, match="raise --kv-cache-memory or lower --max-running-requests"):
        EngineConfig(kv_cache_memory=0.25, max_running_requests=32).resolve(GEMMA_270M)


def test_memory_option_takes_gib_or_a_share_of_available_memory():
    assert memory_gib("1.5") == 1.5
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 2**20
    assert memory_gib("10%") == pytest.approx(available / 10, rel=0.05)
    for bad in ("0", "-1", "x", "150%", "0%"):
        with pytest.raises(Exception, match="kv-cache-memory"):
            memory_gib(bad)


def run_batch(cfg: EngineConfig, model) -> EngineStats:
    rc = cfg.resolve(model)
    stats = EngineStats("memo")
    pool = build_hybrid_kv_pool(full_size=rc.full_pool_size, swa_size=rc.swa_pool_size, page_size=1,
                                layer_is_swa=[True, False], num_kv_heads=1, head_dim=2, dtype=torch.float32,
                                policy="memo", stats=stats.translation, reporter=None)
    sched = Scheduler(rc, KVSlots(pool.allocator, HostKVCache(pool, 0)), stats, eos_ids=[1])
    reqs = [Req(list(range(4, 4 + 200)), SamplingParams(max_new_tokens=40)) for _ in range(16)]
    for r in reqs:
        sched.add(r)
    while (batch := sched.schedule()) is not None:
        sched.process(batch, [7] * len(batch.sample))
    assert all(r.status == "finished" for r in reqs)
    sched.assert_idle_clean()
    return stats


def test_a_full_batch_of_long_requests_never_retracts_on_the_default_sizes():
    """What collapsed c=32 before: more running windows than SWA slots, retracted and recomputed over and
    over. On budget-sized pools twice the running batch of requests longer than the window finish without a
    single retraction (a scheduler with real pools, no model); a SWA pool sized by hand below the running
    batch's windows retracts."""
    model = Gemma3Config.tiny(sliding_window=64)
    base = EngineConfig(model="tiny", max_running_requests=8, chunked_prefill_size=128)
    sized = run_batch(base, model)
    assert sized.retraction_counts == {"offload": 0, "recompute": 0, "other": 0}
    starved = run_batch(base.with_(max_total_tokens=4096, swa_full_tokens_ratio=0.08), model)  # 327 SWA slots
    assert starved.retraction_counts["recompute"] > 0


def test_prefill_weights_are_one_of_the_two_kinds_from_the_command_line_too():
    import argparse

    from runtime.options import add_engine_args, engine_argv

    with pytest.raises(ValueError, match="--prefill-weights must be one of int8-128, gguf"):
        EngineConfig(prefill_weights="int4")
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args([]).prefill_weights == EngineConfig().prefill_weights == "int8-128"
    args = p.parse_args(["--prefill-weights", "gguf"])
    assert engine_argv(args) == ["--prefill-weights", "gguf"]
    with pytest.raises(SystemExit):
        p.parse_args(["--prefill-weights", "int4"])
