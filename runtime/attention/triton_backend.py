"""Triton attention: paged decode and extend kernels over the same key lists as the torch reference.

Without a GPU the kernels run in Triton's interpreter (switched on in `runtime/__init__.py`).
"""

from __future__ import annotations

import torch

from runtime.attention import triton_kernels
from runtime.attention.base import AttentionBackend
from runtime.attention.sliding_window import KVIndexList


class TritonBackend(AttentionBackend):
    name = "triton"

    def attend(self, q, k_buf, v_buf, keys: KVIndexList, layer) -> torch.Tensor:
        meta = self.meta
        out = torch.empty_like(q)  # (T, H, D)
        cap = layer.logit_softcapping or 0.0
        if self.batch.is_decode:
            # The key list of a sliding layer already starts at the window: no mask needed beyond it.
            triton_kernels.decode_attention_fwd(q, k_buf, v_buf, out, keys.indptr, keys.indices, layer.scaling, cap)
        else:
            triton_kernels.extend_attention_fwd(
                q, k_buf, v_buf, out, meta.qo_indptr, keys.indptr, keys.indices, meta.q_positions, keys.start,
                layer.scaling, sliding_window=layer.sliding_window or 0, logit_cap=cap,
                max_extend_len=meta.max_extend_len,
            )
        return out
