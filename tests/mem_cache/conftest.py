import pytest
import torch

from runtime.mem_cache.swa_pool import build_hybrid_kv_pool
from telemetry.logging import EventReporter
from telemetry.ratelimit import RateLimiter
from telemetry.stats import EngineStats


@pytest.fixture
def make_pool():
    """Build a small hybrid pool with its own stats and reporter: make_pool(policy=..., **options)."""

    def make(policy="memo", full_size=32, swa_size=16, page_size=1, sliding=3, **options):
        stats = EngineStats(policy)
        reporter = EventReporter(stats, RateLimiter(interval_s=60.0))
        pool = build_hybrid_kv_pool(
            full_size=full_size, swa_size=swa_size, page_size=page_size,
            layer_is_swa=[True] * sliding + [False], num_kv_heads=1, head_dim=4, dtype=torch.float32,
            policy=policy, stats=stats.translation, reporter=reporter, **options,
        )
        pool.stats, pool.reporter = stats, reporter
        return pool

    return make
