"""Attention in plain torch: the reference everywhere, and the CPU default.

Extend runs one request at a time with masks built from absolute positions. Decode runs the whole batch at
once over a padded (B, L) key table: every listed key of a decode query is visible (the window list already
starts at the window), so only the padding needs masking. The table is built once per forward and key list.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.attention.base import AttentionBackend
from runtime.attention.sliding_window import KVIndexList


class TorchNativeBackend(AttentionBackend):
    name = "torch"

    def init_forward_metadata(self, batch) -> None:
        super().init_forward_metadata(batch)
        self._padded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attend(self, q, k_buf, v_buf, keys: KVIndexList, layer) -> torch.Tensor:
        if self.batch.is_decode:
            return self._decode(q, k_buf, v_buf, keys, layer)
        return self._extend(q, k_buf, v_buf, keys, layer)

    def _padded_table(self, keys: KVIndexList) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L) slots (padding: slot 0, the sink) and the (B, L) mask of real keys, cached per forward."""
        cached = self._padded.get(id(keys))
        if cached is None:
            lens = torch.tensor([b - a for a, b in zip(keys.indptr_list, keys.indptr_list[1:])])
            width = max(int(lens.max()), 1) if lens.numel() else 1
            real = torch.arange(width)[None, :] < lens[:, None]  # (B, L)
            slots = torch.zeros(real.shape, dtype=torch.int64)
            slots[real] = keys.indices.long().cpu()
            device = keys.indices.device
            cached = self._padded[id(keys)] = (slots.to(device), real.to(device))
        return cached

    def _decode(self, q, k_buf, v_buf, keys: KVIndexList, layer) -> torch.Tensor:
        slots, real = self._padded_table(keys)
        B, H, D = q.shape
        group = H // layer.num_kv_heads
        k = k_buf[slots].float()  # (B, L, Hkv, D)
        v = v_buf[slots].float()
        qg = q.float().view(B, layer.num_kv_heads, group, D)  # (B, Hkv, G, D)
        scores = torch.einsum("bkgd,blkd->bkgl", qg, k) * layer.scaling  # (B, Hkv, G, L)
        if layer.logit_softcapping:
            scores = torch.tanh(scores / layer.logit_softcapping) * layer.logit_softcapping
        scores = scores.masked_fill(~real[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bkgl,blkd->bkgd", probs, v)  # (B, Hkv, G, D)
        return out.reshape(B, H, D).to(q.dtype)

    def _extend(self, q, k_buf, v_buf, keys: KVIndexList, layer) -> torch.Tensor:
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
            q_pos = meta.q_positions[qo[b]:qo[b + 1]].long()[:, None]  # (Tq, 1)
            k_pos = starts[b] + torch.arange(slots.numel(), device=q.device)[None, :]  # (1, L)
            visible = k_pos <= q_pos  # (Tq, L)
            if window is not None:
                visible &= q_pos - k_pos < window
            if layer.logit_softcapping:
                scores = torch.einsum("qhd,khd->hqk", qb, kb) * layer.scaling  # (H, Tq, L)
                scores = torch.tanh(scores / layer.logit_softcapping) * layer.logit_softcapping
                probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
                ob = torch.einsum("hqk,khd->qhd", probs, vb)
            else:  # the fused kernel, same math
                ob = F.scaled_dot_product_attention(qb.transpose(0, 1), kb.transpose(0, 1), vb.transpose(0, 1),
                                                    attn_mask=visible, scale=layer.scaling).transpose(0, 1)
            out[qo[b]:qo[b + 1]] = ob.to(q.dtype)
        return out
