"""Requests and their sampling parameters, as the scheduler and the engine see them (no torch here)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

_ids = itertools.count(1)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    ignore_eos: bool = False
    seed: int | None = None  # a generator of the request's own: its draws do not depend on other requests
    logprobs: int | None = None  # None: none; k: the sampled token's log probability and the k most likely

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be within [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be within (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be within [0, 2**64), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be within [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log probability under the model's distribution (log_softmax of the logits it was
    drawn from, before temperature or top-k/top-p), and the `k` most likely tokens as (id, log probability)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
    row: int = -1  # request-table row while admitted
    row_fresh: bool = False  # the row was (re)assigned: the engine must write the whole table row again
    locs: list[int] = field(default_factory=list)  # full slot of each cached position: the one record of them
    swa_released_upto: int = 0
    offloaded: object | None = None  # host copy while retracted (HostKV)
    logits: list | None = None  # sampled-token logits when a caller asks for them
    traceparent: str | None = None  # the client's W3C trace context: its trace continues in ours (tracing)
    generator: object | None = None  # the torch.Generator of a seeded request (engine only)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # with params.logprobs, one per output token
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
        return self.status in ("finished", "aborted", "rejected", "refused", "error")
