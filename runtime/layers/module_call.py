"""Calling a module on the decode path without `nn.Module.__call__`'s frames when nothing is hooked on it.

`module(x)` goes through two Python frames that only look for hooks before calling `forward` (~0.5 us);
a decode step makes 36 such calls (18 layers, 18 attention calls). `call` looks for the forward hooks itself
and calls `forward` directly when there are none; with any (diagnose's mid-forward remap hooks a layer), it
goes through `__call__`, which runs them. No backward hooks are looked for: the decode path runs without grad.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _module


def hooked(module: nn.Module) -> bool:
    """Whether calling `module` would run a forward hook (its own or a global one), or record for autograd."""
    return bool(module._forward_hooks or module._forward_pre_hooks or _module._global_forward_hooks
                or _module._global_forward_pre_hooks or torch.is_grad_enabled())


def call(module: nn.Module, *args):
    """`module(*args)`, cheaper when no forward hook (the module's or a global one) is registered."""
    if hooked(module):
        return module(*args)
    return module.forward(*args)
