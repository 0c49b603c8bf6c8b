"""The per-key token bucket, driven by a fake clock."""

import pytest

from telemetry.ratelimit import RateLimiter


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_once_per_interval():
    clock = FakeClock()
    limiter = RateLimiter(interval_s=10.0, clock=clock)
    assert [limiter.allow("a") for _ in range(3)] == [True, False, False]
    clock.now = 9.999
    assert limiter.allow("a") is False
    clock.now = 10.0
    assert limiter.allow("a") is True
    assert limiter.allow("a") is False


def test_burst_then_refill_and_cap():
    clock = FakeClock()
    limiter = RateLimiter(interval_s=10.0, burst=2, clock=clock)
    assert [limiter.allow("a") for _ in range(3)] == [True, True, False]
    clock.now = 5.0
    assert limiter.allow("a") is False  # half a token
    clock.now = 10.0
    assert limiter.allow("a") is True
    clock.now = 1000.0  # a long quiet spell refills only up to the burst
    assert [limiter.allow("a") for _ in range(3)] == [True, True, False]


def test_keys_are_independent():
    clock = FakeClock()
    limiter = RateLimiter(interval_s=10.0, clock=clock)
    assert limiter.allow(("kv_write", "stale_loc")) is True
    assert limiter.allow(("kv_write", "stale_loc")) is False
    assert limiter.allow(("kv_write", "cross_forward")) is True


@pytest.mark.parametrize("interval_s, burst", [(0.0, 1), (-1.0, 1), (1.0, 0)])
def test_rejects_bad_arguments(interval_s, burst):
    with pytest.raises(ValueError):
        RateLimiter(interval_s, burst)
