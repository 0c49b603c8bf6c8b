"""Requests as the scheduler sees them."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from runtime.layers.sampler import SamplingParams

_ids = itertools.count(1)


class RequestError(ValueError):
    """A request that can never be served as asked (bad input or larger than the engine): a 4xx."""


@dataclass(eq=False)
class Req:
    """One generation request. Callbacks run on the engine thread: keep them short (hand off to a queue).

    States: waiting → running → finished | aborted; or rejected at admission. A retracted request goes
    back to waiting, its KV either offloaded to host memory (`offloaded`) or dropped (recomputed later).
    """

    prompt_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: f"req-{next(_ids)}")
    on_token: Callable[["Req", int], None] | None = None
    on_finish: Callable[["Req"], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    status: str = "waiting"
    finish_reason: str | None = None  # length | stop | abort | error
    error: str | None = None
    # KV bookkeeping (scheduler only)
    row: int = -1
    locs: list[int] = field(default_factory=list)  # full slot of each cached position
    swa_released_upto: int = 0
    offloaded: object | None = None  # host copy while retracted (HostKV)
    logits: list | None = None  # sampled-token logits when a caller asks for them
    # timing
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def cached(self) -> int:
        return len(self.locs)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def done(self) -> bool:
        return self.status in ("finished", "aborted", "rejected")
