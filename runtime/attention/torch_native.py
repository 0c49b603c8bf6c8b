"""Reference attention in plain torch: one request at a time, masks built from absolute positions."""

from __future__ import annotations

import torch

from runtime.attention.base import AttentionBackend
from runtime.attention.sliding_window import KVIndexList


class TorchNativeBackend(AttentionBackend):
    name = "torch"

    def attend(self, q, k_buf, v_buf, keys: KVIndexList, layer) -> torch.Tensor:
        meta = self.meta
        qo, kv, starts = meta.qo_list, keys.indptr_list, keys.start_list
        out = torch.empty_like(q)  # (T, H, D)
        group = layer.num_heads // layer.num_kv_heads
        window = layer.sliding_window
        for b in range(len(qo) - 1):
            qb = q[qo[b]:qo[b + 1]].float()  # (Tq, H, D)
            slots = keys.indices[kv[b]:kv[b + 1]].long()
            kb = k_buf[slots].float().repeat_interleave(group, dim=1)  # (L, H, D)
            vb = v_buf[slots].float().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", qb, kb) * layer.scaling  # (H, Tq, L)
            if layer.logit_softcapping:
                scores = torch.tanh(scores / layer.logit_softcapping) * layer.logit_softcapping
            q_pos = meta.q_positions[qo[b]:qo[b + 1]].long()[:, None]  # (Tq, 1)
            k_pos = starts[b] + torch.arange(slots.numel(), device=q.device)[None, :]  # (1, L)
            visible = k_pos <= q_pos
            if window is not None:
                visible &= q_pos - k_pos < window
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[qo[b]:qo[b + 1]] = torch.einsum("hqk,khd->qhd", probs, vb).to(q.dtype)
        return out
