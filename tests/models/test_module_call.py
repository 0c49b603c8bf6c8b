"""`call` skips `nn.Module.__call__` only when that would change nothing: hooks still run."""

from __future__ import annotations

import torch
from torch import nn

from runtime.layers.module_call import call


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor, y: int) -> torch.Tensor:
        self.calls += 1
        return x + y


def test_without_hooks_it_returns_what_the_module_returns():
    m = Counting()
    with torch.no_grad():
        assert call(m, torch.ones(2), 3).tolist() == [4.0, 4.0] and m.calls == 1


def test_a_forward_hook_and_a_pre_hook_still_run():
    m, seen = Counting(), []
    pre = m.register_forward_pre_hook(lambda mod, args: (args[0] * 10, args[1]))
    post = m.register_forward_hook(lambda mod, args, out: seen.append(out.tolist()))
    with torch.no_grad():
        out = call(m, torch.ones(1), 1)
    assert out.tolist() == [11.0] and seen == [[11.0]]
    pre.remove()
    post.remove()
    with torch.no_grad():
        assert call(m, torch.ones(1), 1).tolist() == [2.0] and seen == [[11.0]]


def test_a_global_hook_still_runs():
    m, seen = Counting(), []
    handle = nn.modules.module.register_module_forward_hook(lambda mod, args, out: seen.append(type(mod).__name__))
    try:
        with torch.no_grad():
            call(m, torch.ones(1), 1)
    finally:
        handle.remove()
    assert seen == ["Counting"]
