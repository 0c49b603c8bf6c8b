"""A per-key token bucket, so a bug that fires on every forward logs a few records, not millions."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable


class RateLimiter:
    """Allow up to `burst` records per key at once, then one more every `interval_s` seconds.

    With `burst=1` this is "once per interval". Each key keeps its own bucket; keys are expected to come from
    closed sets (e.g. folded (site, classification) pairs), so the table stays small.
    """

    def __init__(self, interval_s: float, burst: int = 1, clock: Callable[[], float] = time.monotonic):
        if interval_s <= 0 or burst < 1:
            raise ValueError(f"need interval_s > 0 and burst >= 1, got {interval_s}, {burst}")
        self._interval = float(interval_s)
        self._burst = float(burst)
        self._clock = clock
        self._buckets: dict[Hashable, tuple[float, float]] = {}  # key -> (tokens, time of last refill)

    def allow(self, key: Hashable) -> bool:
        now = self._clock()
        tokens, last = self._buckets.get(key, (self._burst, now))
        tokens = min(self._burst, tokens + (now - last) / self._interval)
        if tokens >= 1.0:
            self._buckets[key] = (tokens - 1.0, now)
            return True
        self._buckets[key] = (tokens, now)
        return False
