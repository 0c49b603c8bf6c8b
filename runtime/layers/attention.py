"""The attention layer: a description of one layer's attention, handed with q/k/v to the context's backend.

The layer owns no KV cache and no masking logic. The backend installed in the forward context
(`runtime.context.get_forward_context().attn_backend`) stores k/v in the KV pool at the batch's locations
(translating them to SWA-pool locations on sliding layers) and attends over each request's cached tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.context import get_forward_context


class Attention(nn.Module):
    """Backend contract: `attn_backend.forward(q, k, v, layer)` with q (T, H, D) and k, v (T, Hkv, D),
    already q/k-normed and rotated, returns the attention output as (T, H, D) or (T, H*D).

    `layer` is this module: backends read `layer_id`, `num_heads`, `num_kv_heads`, `head_dim`, `scaling`
    (multiplies q.k), `sliding_window` (None on global layers; else a query at position p sees keys at
    positions p - sliding_window + 1 .. p) and `logit_softcapping` (None for Gemma 3).
    """

    def __init__(
        self,
        layer_id: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: float,
        sliding_window: int | None = None,
        logit_softcapping: float | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.sliding_window = sliding_window
        self.logit_softcapping = logit_softcapping

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        backend = get_forward_context().attn_backend
        if backend is None:
            raise RuntimeError("no attention backend installed: run the model inside a forward context")
        out = backend.forward(q, k, v, self)  # (T, H, D) or (T, H*D)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)  # (T, H*D)

    def extra_repr(self) -> str:
        return (
            f"layer_id={self.layer_id}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, scaling={self.scaling:.6g}, sliding_window={self.sliding_window}"
        )
