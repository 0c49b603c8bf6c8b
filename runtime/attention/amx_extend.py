"""Extend attention on AMX: each request's new tokens through torch's fused attention in bfloat16.

Where the CPU has AMX, torch's `scaled_dot_product_attention` runs bfloat16 products on its tiles. A 600-token
prompt's attention over its own keys in a layer (4 query heads on one kv head, 256 wide) took 2.5 ms there (2.9
with the 512-token window) against 5.4 ms on our kernel's AVX512-BF16 tiles (`extend_attention`), the key gather
included (2-core Xeon with AMX, docs/performance.md). Each request is attended alone: its keys gathered from the
pool and repeated for every query head of their group (the fused kernel's grouped path was 3.4x slower than
repeating), plain causal where the keys are the queries themselves and within the window, else under an explicit
mask of what each query sees.

The kernels' own tiles run on AMX-BF16 where they were built with it (`extend_tiles.h`), faster again: the same
600-token layer 1.6-1.7 against 3.2-3.7 ms here, 1000 tokens in a window 3.3 against 10.4. This route serves where
the CPU has AMX and those tiles do not run on it (a compiler without AMX intrinsics, tiles not granted by the OS).

A short request (fewer than `MIN_EXTEND` new tokens: a piece of a chunked prompt, a speculative check) costs more
here than it saves, so the short ones go to the kernel in one call of their own. Before, one of them sent the whole
extend to the kernel: 8 prompts of 680 tokens, whose every 2048-token chunk holds such a piece, prefilled 1.13-1.34x
faster split (paired medians of two runs in one process, same Xeon).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from runtime.attention.sliding_window import KVIndexList, seen_by
from runtime.layers.linear import CPU_HAS_AMX

# Requests shorter than this go to our kernel (one call for all of them): the per-request calls here cost more
# than they save on a few tokens. A layer, here against the kernel: 48 new tokens of a fresh prompt 0.24 against
# 0.10 ms; 48 after 952 in a 512-token window 1.33 against 1.16; 8 after 600 on a full layer 0.68 against 0.32.
MIN_EXTEND = 64


def takes(q: torch.Tensor, qo: list[int], softcap: float) -> bool:
    """Whether an extend of these queries runs here: AMX, bfloat16, no soft-capping, a request long enough."""
    return (CPU_HAS_AMX and q.dtype == torch.bfloat16 and not softcap
            and max(b - a for a, b in zip(qo, qo[1:])) >= MIN_EXTEND)


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, keys: KVIndexList,
                     qo: list[int], positions: torch.Tensor, prefix: list[int], window: int, scaling: float,
                     fused=None) -> torch.Tensor:
    """q (T, H, D) -> (T, H, D): query rows qo[b]..qo[b+1]-1 of request b (at positions prefix[b] on, each row's
    in `positions`) over that request's listed keys (`keys`, at positions keys.start_list[b] on), those at or
    before its position and, where `window` > 0, fewer than `window` before it. The same contract as the kernels'
    `extend_attention`, which `fused` (the kernels, if given) runs for the requests shorter than `MIN_EXTEND`."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_buf.shape[1]  # query heads per kv head
    short = []
    for b in range(len(qo) - 1):
        t0, t1 = qo[b], qo[b + 1]
        if fused is not None and t1 - t0 < MIN_EXTEND:
            short.append(b)
            continue
        slots = keys.indices[keys.indptr_list[b]:keys.indptr_list[b + 1]].long()
        k = _heads(k_buf, slots, group)  # (1, H, L, D)
        v = _heads(v_buf, slots, group)
        qb = q[t0:t1].transpose(0, 1)[None]  # (1, H, Tq, D)
        first, start, L = prefix[b], keys.start_list[b], slots.numel()
        if start == first and L == t1 - t0:  # the keys are the queries: plain causal up to the window
            n = L if not window else min(L, window)
            out[t0:t0 + n] = _attend(qb[:, :, :n], k[:, :, :n], v[:, :, :n], None, scaling)
            if n < L:  # the rows past the window see the keys from n - window + 1 on
                lo = n - window + 1
                out[t0 + n:t1] = _attend(qb[:, :, n:], k[:, :, lo:], v[:, :, lo:],
                                         _visible(first + n, L - n, first + lo, L - lo, window), scaling)
        else:
            out[t0:t1] = _attend(qb, k, v, _visible(first, t1 - t0, start, L, window), scaling)
    if short:
        rows = torch.cat([torch.arange(qo[b], qo[b + 1]) for b in short])
        out[rows] = _on_kernel(fused, q[rows], k_buf, v_buf, keys, qo, positions[rows], short, window, scaling)
    return out


def _on_kernel(fused, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, keys: KVIndexList,
               qo: list[int], positions: torch.Tensor, requests: list[int], window: int,
               scaling: float) -> torch.Tensor:
    """The kernels' extend_attention over `requests` alone (q and positions: their rows, in order)."""
    kp = keys.indptr_list
    indices = torch.cat([keys.indices[kp[b]:kp[b + 1]] for b in requests])
    indptr = torch.tensor([0, *itertools.accumulate(kp[b + 1] - kp[b] for b in requests)], dtype=torch.int32)
    q_indptr = torch.tensor([0, *itertools.accumulate(qo[b + 1] - qo[b] for b in requests)], dtype=torch.int32)
    start = torch.tensor([keys.start_list[b] for b in requests], dtype=torch.int32)
    return fused.extend_attention(q.contiguous(), k_buf, v_buf, indices, indptr, start, q_indptr,
                                  positions.contiguous(), window, scaling, 0.0)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scaling: float) -> torch.Tensor:
    """(1, H, Tq, D) -> (Tq, H, D); causal (top-left) where mask is None."""
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling)
    return o[0].transpose(0, 1)


def _visible(q_first: int, q_count: int, k_first: int, k_count: int, window: int) -> torch.Tensor:
    """(q_count, k_count) bool: which keys (at positions k_first on) each query (at q_first on) sees."""
    return seen_by(torch.arange(q_first, q_first + q_count), torch.arange(k_first, k_first + k_count), window)


def _heads(buf: torch.Tensor, slots: torch.Tensor, group: int) -> torch.Tensor:
    """Pool rows `slots` of buf (S, Hkv, D) as (1, Hkv * group, L, D), each kv head repeated for its group."""
    rows = buf.index_select(0, slots).transpose(0, 1)  # (Hkv, L, D)
    return rows.repeat_interleave(group, dim=0)[None]
