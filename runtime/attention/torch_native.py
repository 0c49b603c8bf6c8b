"""Attention in plain torch: the reference everywhere, and the CPU default.

Decode and extend both run the whole batch in one call over padded tables built once per forward and key
list: queries (B, Tq) and keys (B, L), padding pointing at slot 0 (the sink), and a (B, 1, Tq, L) mask of
what each query may see (its request's keys, causal, within the window on sliding layers). A decode query
sees every listed key (the window list already starts at the window), so only padding is masked; a batch
without padding (one request, or equal lengths) needs no mask at all, and a fresh single-request prefill
is plain causal attention. Attention is computed in float32 through `scaled_dot_product_attention` (the
fused kernel), whatever the model's dtype: on CPUs without bfloat16 units its bfloat16 path is an order of
magnitude slower (13 ms against 1 ms for a batch-8 decode layer over 600 keys), and even with them 3-5x
slower than float32. The exception is decode in a lower-precision model: two batched matmuls in the model's
dtype (in float32 for one or two requests, where that is faster), softmax in float32 (`_decode_in_own_dtype`),
half the time of the upcast and fused kernel; its key lists are padded to a multiple of `KEY_BUCKET`, so that
the matmuls' shapes repeat from step to step, and the padding is masked by an additive bias made once per
forward, which the first matmul adds. Logit soft-capping, which the fused kernel cannot express, takes the
explicit path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime import kernels
from runtime.attention import amx_extend
from runtime.attention.base import AttentionBackend
from runtime.attention.sliding_window import KVIndexList, seen_by


@dataclass
class _Plan:
    """How one key list is laid out for one forward (per sliding window, for extend)."""

    slots: torch.Tensor  # (B, L) int64 pool slots, padding 0
    mask: torch.Tensor | None  # (B, 1, Tq, L) bool, None when every listed key is visible
    bias: torch.Tensor | None = None  # (B Hkv, 1, L) 0 or -inf in the dtype `_decode_in_own_dtype` multiplies in
    causal: bool = False  # a single request whose keys are exactly its queries: plain causal attention
    q_index: torch.Tensor | None = None  # (B, Tq) int64 rows of the flattened T (padding 0); None: B == 1
    q_real: torch.Tensor | None = None  # (B, Tq) bool, the real rows of q_index
    # (t0, t1, j0, j1): query rows t0..t1-1 see no key outside columns j0..j1-1 (long extends only), so
    # each block is attended over those columns alone instead of the whole masked table
    blocks: list[tuple[int, int, int, int]] | None = None


def fused_extend(fused, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, keys: KVIndexList,
                 qo: list[int], qo_indptr: torch.Tensor, q_positions: torch.Tensor, prefix: list[int],
                 layer) -> torch.Tensor:
    """A bfloat16 extend's attention on the fused kernels (`fused`), the keys read in place from the pool, each new
    token over the keys it sees, none masked, none padded (in tiles of 16 query rows, on AMX-BF16 where the kernels
    were built with it); through torch's on AMX tiles (`amx_extend`) where the CPU has AMX and the kernels' tiles do
    not run on it. What `benchmarks/quality.py` scores as the runtime's attention too."""
    window, softcap = layer.sliding_window or 0, layer.logit_softcapping or 0.0
    if amx_extend.takes(q, qo, softcap) and not fused.amx_attention_on():
        return amx_extend.extend_attention(q, k_buf, v_buf, keys, qo, q_positions, prefix, window, layer.scaling,
                                           fused)
    return fused.extend_attention(q.contiguous(), k_buf, v_buf, keys.indices, keys.indptr, keys.start, qo_indptr,
                                  q_positions, window, layer.scaling, softcap)


class TorchNativeBackend(AttentionBackend):
    name = "torch"

    def __init__(self, pool, req_to_token, sliding_window: int | None):
        super().__init__(pool, req_to_token, sliding_window)
        self._plans: dict[tuple[int, int | None], _Plan] = {}  # (id of a key list, window) -> plan

    def init_forward_metadata(self, batch) -> None:
        super().init_forward_metadata(batch)
        self._plans = {}

    def attends_in_place(self, dtype: torch.dtype) -> bool:
        """A decode forward whose rows and KV pool are in the kernels' dtype: `attend` would take
        `decode_attention`, as the fused decode stack does."""
        return (self.batch is not None and self.batch.is_decode and self.pool.full_pool.dtype == dtype
                and self.pool.swa_pool.dtype == dtype and type(self).attend is TorchNativeBackend.attend)

    def attend(self, q, k_buf, v_buf, keys: KVIndexList, layer) -> torch.Tensor:
        decode = self.batch.is_decode
        fused = kernels.for_tensor(q) if k_buf.dtype == q.dtype else None
        if fused is not None and decode:  # one pass over the keys in place, float32 (`runtime.kernels`)
            return fused.decode_attention(q.contiguous(), k_buf, v_buf, keys.indices, keys.indptr, layer.scaling,
                                          layer.logit_softcapping or 0.0)
        meta = self.meta
        if fused is not None:
            return fused_extend(fused, q, k_buf, v_buf, keys, meta.qo_list, meta.qo_indptr, meta.q_positions,
                                self.batch.prefix_lens, layer)
        window = None if decode else layer.sliding_window
        plan = self._plans.get((id(keys), window))
        if plan is None:
            if decode:
                own_dtype = q.dtype != torch.float32 and not layer.logit_softcapping  # `_decode_in_own_dtype`
                bias_for = (layer.num_kv_heads, _decode_matmul_dtype(q.dtype, keys)) if own_dtype else None
                plan = self._decode_plan(keys, KEY_BUCKET if own_dtype else 1, bias_for)
            else:
                plan = self._extend_plan(keys, window)
            self._plans[(id(keys), window)] = plan
        if decode:
            qb = q[:, :, None, :]  # (B, H, 1, D)
        else:
            qb = (q[None] if plan.q_index is None else q[plan.q_index]).transpose(1, 2)  # (B, H, Tq, D)
        k, v = _gather(k_buf, plan.slots), _gather(v_buf, plan.slots)  # (B, Hkv, L, D)
        if decode and q.dtype != torch.float32 and not layer.logit_softcapping:
            return _decode_in_own_dtype(qb, k, v, plan.bias, layer).reshape(q.shape)
        if plan.blocks is None:
            out = _attention(qb, k, v, plan.mask, plan.causal, layer)  # (B, H, Tq, D)
        else:
            out = qb.new_zeros(qb.shape)  # rows no block covers are padding, dropped below
            for t0, t1, j0, j1 in plan.blocks:
                out[:, :, t0:t1] = _attention(qb[:, :, t0:t1], k[:, :, j0:j1], v[:, :, j0:j1],
                                              plan.mask[..., t0:t1, j0:j1], False, layer)
        if decode:
            return out.reshape(q.shape)  # Tq = 1
        out = out.transpose(1, 2)  # (B, Tq, H, D)
        return out[0] if plan.q_real is None else out[plan.q_real]  # (T, H, D)

    # ---- plans (once per forward and key list) -----------------------------------------------------------
    @staticmethod
    def _key_table(keys: KVIndexList, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(B, L) slots (padding: slot 0, the sink), the (B, L) mask of real keys, and the lengths; L the
        longest list rounded up to `multiple`."""
        lens = [b - a for a, b in zip(keys.indptr_list, keys.indptr_list[1:])]
        device = keys.indices.device
        width = -(-max(max(lens, default=0), 1) // multiple) * multiple
        real = torch.arange(width, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]  # (B, L)
        slots = torch.zeros(real.shape, dtype=torch.int64, device=device)
        slots[real] = keys.indices.long()
        return slots, real, lens

    def _decode_plan(self, keys: KVIndexList, multiple: int, bias_for: tuple[int, torch.dtype] | None) -> _Plan:
        """`bias_for`: (kv heads, dtype) of the additive mask `_decode_in_own_dtype` takes, None for a mask."""
        slots, real, lens = self._key_table(keys, multiple)
        if bias_for is not None:
            heads, dtype = bias_for
            bias = torch.zeros(real.shape, dtype=dtype, device=real.device).masked_fill_(~real, float("-inf"))
            return _Plan(slots, None, bias=bias.repeat_interleave(heads, 0)[:, None, :])  # (B Hkv, 1, L)
        padded = min(lens, default=0) < slots.shape[1]
        return _Plan(slots, real[:, None, None, :] if padded else None)  # mask (B, 1, 1, L)

    def _extend_plan(self, keys: KVIndexList, window: int | None) -> _Plan:
        slots, k_real, _ = self._key_table(keys)
        device = slots.device
        qo = self.meta.qo_list
        B, L = slots.shape
        extend = [b - a for a, b in zip(qo, qo[1:])]
        Tq = max(extend)
        if B == 1 and L == Tq and keys.start_list[0] == self.batch.prefix_lens[0] and (window is None or L <= window):
            return _Plan(slots, None, causal=True)  # the keys are the queries themselves, all within the window
        q_index = q_real = None
        q_pos = self.meta.q_positions.long()[None]  # (1, T)
        if B > 1:
            t = torch.arange(Tq, device=device)[None, :]  # (1, Tq)
            q_real = t < torch.tensor(extend, device=device)[:, None]  # (B, Tq)
            q_index = torch.where(q_real, torch.tensor(qo[:-1], device=device)[:, None] + t, 0)
            q_pos = q_pos[0, q_index]  # (B, Tq)
        k_pos = torch.tensor(keys.start_list, device=device)[:, None] + torch.arange(L, device=device)[None]  # (B, L)
        visible = k_real[:, None, :] & seen_by(q_pos, k_pos, window)  # (B, Tq, L)
        if q_real is not None:
            visible |= ~q_real[:, :, None]  # padded query rows see everything (finite); their rows are dropped
        blocks = self._query_blocks(extend, keys.start_list, L, window) if Tq > QUERY_BLOCK else None
        return _Plan(slots, visible[:, None], q_index=q_index, q_real=q_real, blocks=blocks)

    def _query_blocks(self, extend: list[int], key_starts: list[int], L: int,
                      window: int | None) -> list[tuple[int, int, int, int]]:
        """Blocks of QUERY_BLOCK query rows and the key columns any real row of the block can see: request b's
        row t is position prefix_b + t, its key column j position key_starts[b] + j; it sees columns up to its
        own position and, on a sliding layer, back to window - 1 before it. Blocks of padding rows only are
        left out. The fused kernel computes every block of a masked table, so a long causal or windowed
        extend (a 2048-token chunk) pays for the masked part in full unless the table is cut like this."""
        prefix = self.batch.prefix_lens
        blocks = []
        for t0 in range(0, max(extend), QUERY_BLOCK):
            t1 = min(t0 + QUERY_BLOCK, max(extend))
            lo, hi = L, 0
            for b, e in enumerate(extend):
                if t0 >= e:
                    continue
                first, last = prefix[b] + t0 - key_starts[b], prefix[b] + min(t1, e) - 1 - key_starts[b]
                lo = min(lo, 0 if window is None else max(0, first - window + 1))
                hi = max(hi, last + 1)
            if hi > lo:
                blocks.append((t0, t1, lo, min(hi, L)))
        return blocks


# Query rows per block of a long extend's attention (`TorchNativeBackend._query_blocks`).
QUERY_BLOCK = 256

# Key lists of a bfloat16/float16 decode are padded to a multiple of this. oneDNN, which runs those batched
# matmuls, prepares a kernel per shape and keeps it for the next call of that shape; the keys of a global
# layer grow by one every step, and a new shape every step cost ~1 ms per matmul (against ~60 us reused).
KEY_BUCKET = 64


def _gather(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows `slots` (B, L) of a pool buffer (S, Hkv, D) as (B, Hkv, L, D). `index_select` on the flattened
    slots: 4-5x faster than advanced indexing for these row gathers."""
    rows = buf.index_select(0, slots.view(-1)).view(*slots.shape, *buf.shape[1:])  # (B, L, Hkv, D)
    return rows.transpose(1, 2)


# Decode batches of up to this many requests multiply in float32 in `_decode_in_own_dtype`: a bfloat16 batched
# matmul has a fixed cost that float32's has not (on the 2-core Xeon with AMX, 2 threads, one request over 320
# keys: 24 against 7 us a product; the layer's attention 103 against 65 us with the float32 copies of its keys
# and values, 108 against 90 us at 2 requests), and from 4 requests on those copies cost more than it saves
# (204 against 244 us).
FLOAT32_DECODE_MAX_REQUESTS = 2


def _decode_matmul_dtype(dtype: torch.dtype, keys: KVIndexList) -> torch.dtype:
    return torch.float32 if len(keys.indptr_list) - 1 <= FLOAT32_DECODE_MAX_REQUESTS else dtype


def _decode_in_own_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                         layer) -> torch.Tensor:
    """Decode attention of a lower-precision model (bfloat16, float16) as two batched matmuls in its own dtype,
    the softmax in float32: what the reference implementation's eager attention does in that dtype. For one
    query per request the fused kernel is slower here (1.1-1.3 ms against 0.4-0.6 ms for a batch-8 layer over
    600 keys; 10.7 against 4.1 ms at batch 32), mostly the float32 copies of the gathered keys and values.
    The scaling and the padding bias ride on the first matmul (`baddbmm`: `bias + scaling * q.k`, one rounding
    to the model's dtype; the same bits as the product rounded, then scaled in float32 and masked, whenever
    the scaling is a power of two, as Gemma 3's 1/16), and the softmax reads its input as float32 itself.
    A bias in float32 (`FLOAT32_DECODE_MAX_REQUESTS`) makes both products float32, without those roundings.
    q (B, H, 1, D), k/v (B, Hkv, L, D), bias (B Hkv, 1, L) -> (B, H, 1, D) in q's dtype."""
    B, H, _, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = H // Hkv
    dtype = bias.dtype
    # 3-D batched matmuls over (request, kv head): query head h reads kv head h // G. `matmul` on the 4-D
    # views copied the gathered keys first (155 against 49 us at batch 1 over 600 keys).
    qg = q.reshape(B * Hkv, G, D).to(dtype)
    k, v = k.reshape(B * Hkv, L, D).to(dtype), v.reshape(B * Hkv, L, D).to(dtype)
    scores = torch.baddbmm(bias, qg, k.transpose(1, 2), alpha=layer.scaling)  # (B Hkv, G, L)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    return torch.bmm(probs, v).reshape(B, H, 1, D).to(q.dtype)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
               layer) -> torch.Tensor:
    """q (B, H, Tq, D), k/v (B, Hkv, L, D), mask (B, 1, Tq, L) or None -> (B, H, Tq, D) in q's dtype,
    computed in float32."""
    q32, k, v = q.float(), k.float(), v.float()
    if not layer.logit_softcapping:
        out = F.scaled_dot_product_attention(q32, k, v, attn_mask=mask, is_causal=causal, scale=layer.scaling,
                                             enable_gqa=True)
        return out.to(q.dtype)
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (B, H, L, D): query head h reads kv head h // group
    v = v.repeat_interleave(group, dim=1)
    scores = q32 @ k.transpose(-1, -2) * layer.scaling  # (B, H, Tq, L)
    scores = torch.tanh(scores / layer.logit_softcapping) * layer.logit_softcapping
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).to(q.dtype)
