"""The forward context: which forward is running, in which mode, with which batch and backend.

One object is installed for the duration of a forward by `forward_context(...)` (nesting is refused), so
layers and the translation cache read it instead of having it threaded through every call. Outside a
forward the context is `IDLE` (forward_id 0, mode "none").
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from telemetry.logging import bind_forward, clear_forward


@dataclass(frozen=True, slots=True)
class ForwardContext:
    forward_id: int
    mode: str  # eager_extend | eager_decode | graph_capture | graph_replay | none
    batch: Any = None
    attn_backend: Any = None

    @property
    def capturing(self) -> bool:
        return self.mode == "graph_capture"


IDLE = ForwardContext(forward_id=0, mode="none")
_current: ForwardContext = IDLE


def get_forward_context() -> ForwardContext:
    return _current


@contextmanager
def forward_context(ctx: ForwardContext, bind_logging: bool = True) -> Iterator[ForwardContext]:
    """Install `ctx` for one forward; the forward id and mode also go into structured-log context."""
    global _current
    if _current is not IDLE:
        raise RuntimeError(f"forward {ctx.forward_id} started inside forward {_current.forward_id}")
    _current = ctx
    if bind_logging:
        bind_forward(ctx.forward_id, ctx.mode)
    try:
        yield ctx
    finally:
        _current = IDLE
        if bind_logging:
            clear_forward()
