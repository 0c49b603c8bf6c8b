"""Paged attention kernels (Triton) for the `triton` attention backend.

Both kernels read K/V from a paged pool through a flattened list of pool slots (CSR layout: an `indptr` of
B+1 offsets into `indices`). The slots are already in the layer's own pool (full pool for full-attention
layers, SWA pool for sliding layers); this module never translates locations. Slot 0 is the pool's padding
sink, so masked-out lanes load slot 0 and stay in bounds.

- `decode_attention_fwd`: one query per request, split-KV ("flash decoding"): stage 1 computes a partial
  softmax per (request, kv head, split) with all query heads of the GQA group in one tile; stage 2 merges
  the splits with their log-sum-exp. The split count is fixed per launch (no device-to-host sync), so the
  launch is CUDA-graph safe.
- `extend_attention_fwd`: prefill/extend for a ragged batch; the mask is built from absolute positions
  (causal plus optional sliding window), so a cached prefix and chunked prefill need no special case.

Softmax is online and in float32 (base-2 exponentials with log2(e) folded in). Rows with no visible key
produce zeros. On CPU the kernels run only under `TRITON_INTERPRET=1` (set before triton is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _soft_cap(s, cap):
    # cap * tanh(s / cap), with tanh(x) = 1 - 2 / (exp(2x) + 1): saturates cleanly to +-1 at both ends.
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST (interpreter only): it multiplies bfloat16 tiles as their raw uint16 bits; give it float32.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _decode_split_kernel(
    Q, K, V, MidO, MidLse, kv_indptr, kv_indices,
    sm_scale, logit_cap, num_splits,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    HAS_CAP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    kv_start = tl.load(kv_indptr + b)
    kv_len = tl.load(kv_indptr + b + 1) - kv_start
    # Splits cover whole BLOCK_N tiles; trailing splits of a short request are empty (lse = -inf).
    per_split = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, kv_len)

    offs_g = tl.arange(0, BLOCK_H)
    head_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_mask[:, None], other=0.0)  # (BLOCK_H, D)

    m_i = tl.full([BLOCK_H], -1e30, dtype=tl.float32)  # finite: exp2(m_old - m_new) never sees inf - inf
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_V], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        slots = tl.load(kv_indices + kv_start + offs_n, mask=n_mask, other=0).to(tl.int64)
        k = tl.load(K + slots[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None],
                    mask=n_mask[None, :], other=0.0)  # (D, BLOCK_N)
        s = _dot(q, k, PRECISION, UPCAST) * sm_scale  # (BLOCK_H, BLOCK_N)
        if HAS_CAP:
            s = _soft_cap(s, logit_cap)
        s = tl.where(n_mask[None, :], s * 1.4426950408889634, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_dv[None, :],
                    mask=n_mask[:, None], other=0.0)  # (BLOCK_N, Dv)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new

    nonempty = l_i > 0.0
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    tl.store(MidO + b * stride_mb + heads[:, None] * stride_mh + split * stride_ms + offs_dv[None, :],
             out, mask=head_mask[:, None])
    tl.store(MidLse + b * stride_lb + heads * stride_lh + split, lse, mask=head_mask)


@triton.jit
def _decode_merge_kernel(
    MidO, MidLse, O, num_splits,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    BLOCK_S: tl.constexpr, HEAD_DIM_V: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    offs_dv = tl.arange(0, HEAD_DIM_V)
    lse = tl.load(MidLse + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # all splits empty: every weight is 0
    part = tl.load(MidO + b * stride_mb + h * stride_mh + offs_s[:, None] * stride_ms + offs_dv[None, :],
                   mask=s_mask[:, None], other=0.0)  # (BLOCK_S, Dv)
    denom = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_dv, out.to(O.dtype.element_ty))


@triton.jit
def _extend_kernel(
    Q, K, V, O, qo_indptr, kv_indptr, kv_indices, q_positions, kv_positions_start,
    sm_scale, logit_cap, sliding_window,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    HAS_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    m_block = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    kv_head = h // GROUP

    q_start = tl.load(qo_indptr + b)
    q_len = tl.load(qo_indptr + b + 1) - q_start
    kv_start = tl.load(kv_indptr + b)
    kv_len = tl.load(kv_indptr + b + 1) - kv_start
    pos0 = tl.load(kv_positions_start + b)

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len  # all false for blocks past this request's end: the loop below is empty
    rows = (q_start + offs_m).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    q_pos = tl.load(q_positions + rows, mask=m_mask, other=0)
    q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None], other=0.0)  # (BLOCK_M, D)

    # Only keys some row of this block can see: j <= max(q_pos) - pos0, and inside the window of min(q_pos).
    hi = tl.maximum(tl.minimum(kv_len, tl.max(tl.where(m_mask, q_pos, -1), 0) - pos0 + 1), 0)
    lo = 0
    if HAS_WINDOW:
        q_min = tl.min(tl.where(m_mask, q_pos, 1 << 30), 0)
        lo = tl.maximum(q_min - sliding_window + 1 - pos0, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        slots = tl.load(kv_indices + kv_start + offs_n, mask=n_mask, other=0).to(tl.int64)
        k = tl.load(K + slots[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None],
                    mask=n_mask[None, :], other=0.0)  # (D, BLOCK_N)
        s = _dot(q, k, PRECISION, UPCAST) * sm_scale  # (BLOCK_M, BLOCK_N)
        if HAS_CAP:
            s = _soft_cap(s, logit_cap)
        k_pos = pos0 + offs_n
        visible = n_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (q_pos[:, None] - k_pos[None, :] < sliding_window)
        s = tl.where(visible, s * 1.4426950408889634, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_dv[None, :],
                    mask=n_mask[:, None], other=0.0)  # (BLOCK_N, Dv)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new

    nonempty = l_i > 0.0
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    tl.store(O + rows[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
             out.to(O.dtype.element_ty), mask=m_mask[:, None])


# ---------------------------------------------------------------------------------------------- launchers


def _check_pool_and_dims(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         o: torch.Tensor) -> tuple[int, int]:
    """Validate the tensors shared by both kernels; returns (GQA group size, Dv)."""
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("o", o)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D, got shape {tuple(t.shape)}")
        if t.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
    if k_buffer.dtype != q.dtype or v_buffer.dtype != q.dtype:
        raise TypeError(f"q, k_buffer and v_buffer must share a dtype, got {q.dtype}, {k_buffer.dtype}, "
                        f"{v_buffer.dtype}")
    if k_buffer.shape[:2] != v_buffer.shape[:2]:
        raise ValueError(f"k_buffer {tuple(k_buffer.shape)} and v_buffer {tuple(v_buffer.shape)} disagree on "
                         "(slots, kv heads)")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, head_dim_v = k_buffer.shape[1], v_buffer.shape[2]
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if k_buffer.shape[2] != head_dim:
        raise ValueError(f"q head_dim {head_dim} != k_buffer head_dim {k_buffer.shape[2]}")
    for name, d in (("head_dim", head_dim), ("v head_dim", head_dim_v)):
        if d < 16 or d > 256 or d & (d - 1):
            raise ValueError(f"{name} must be a power of two in [16, 256], got {d}")
    if o.shape[1:] != (num_heads, head_dim_v):
        raise ValueError(f"o has shape {tuple(o.shape)}, expected (*, {num_heads}, {head_dim_v})")
    if q.device.type == "cpu" and not interpreter_active():
        raise RuntimeError("CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before triton "
                           "is first imported")
    return num_heads // num_kv_heads, head_dim_v


def interpreter_active() -> bool:
    """True when these kernels and triton's own library run under the interpreter. TRITON_INTERPRET is read
    when each function is decorated, so it must be set before triton is first imported."""
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(tl.sum, InterpretedFunction) and isinstance(_extend_kernel, InterpretedFunction)


def _check_index(name: str, t: torch.Tensor, length: int | None, device: torch.device) -> None:
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != 1 or (length is not None and t.shape[0] != length):
        expected = f"({length},)" if length is not None else "1-D"
        raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not silently drop to tf32 on tensor cores; 16-bit inputs use the default path.
    return "ieee" if dtype == torch.float32 or _upcast_dot(dtype) else "tf32"


def _upcast_dot(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and interpreter_active()


def _default_num_kv_splits(q: torch.Tensor, batch: int, num_kv_heads: int) -> int:
    if not q.is_cuda:
        return 2  # exercises the merge in interpreter tests without many empty programs
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    want = triton.cdiv(2 * sms, max(batch * num_kv_heads, 1))
    return max(1, min(32, triton.next_power_of_2(want)))


def decode_attention_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, o: torch.Tensor,
                         kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sm_scale: float,
                         logit_cap: float = 0.0, *, num_kv_splits: int | None = None) -> torch.Tensor:
    """Decode attention over paged KV: o[b] = softmax(q[b] . K[slots_b]) V[slots_b].

    q: (B, H, D); k_buffer: (S, Hkv, D) and v_buffer: (S, Hkv, Dv) this layer's pool buffers; o: (B, H, Dv)
    written in place (and returned). kv_indptr: (B+1,) int32 offsets into kv_indices; kv_indices: (N,) int32
    pool slots each request attends to, already restricted to the window for sliding layers. A request with
    no keys gets zeros. No device-to-host sync: `num_kv_splits` (default: from SM count and batch size)
    fixes the launch shape, so the call can be captured in a CUDA graph.
    """
    group, head_dim_v = _check_pool_and_dims(q, k_buffer, v_buffer, o)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if o.shape[0] != batch:
        raise ValueError(f"o has {o.shape[0]} rows, q has {batch}")
    _check_index("kv_indptr", kv_indptr, batch + 1, q.device)
    _check_index("kv_indices", kv_indices, None, q.device)
    if batch == 0:
        return o
    splits = num_kv_splits if num_kv_splits is not None else _default_num_kv_splits(q, batch, num_kv_heads)
    if splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {splits}")

    mid_o = torch.empty((batch, num_heads, splits, head_dim_v), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
    block_n = (64 if head_dim <= 128 else 32) if q.is_cuda else 16
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, k_buffer, v_buffer, mid_o, mid_lse, kv_indptr, kv_indices,
        float(sm_scale), float(logit_cap), splits,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, HAS_CAP=logit_cap > 0,
        PRECISION=_precision(q.dtype), UPCAST=_upcast_dot(q.dtype),
        num_warps=4, num_stages=2,
    )
    _decode_merge_kernel[(batch, num_heads)](
        mid_o, mid_lse, o, splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        o.stride(0), o.stride(1),
        BLOCK_S=triton.next_power_of_2(splits), HEAD_DIM_V=head_dim_v, num_warps=4 if head_dim_v > 64 else 2,
    )
    return o


def extend_attention_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, o: torch.Tensor,
                         qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                         q_positions: torch.Tensor, kv_positions_start: torch.Tensor, sm_scale: float,
                         sliding_window: int = 0, logit_cap: float = 0.0, *,
                         max_extend_len: int | None = None) -> torch.Tensor:
    """Prefill/extend attention over paged KV for a ragged batch.

    q: (T, H, D) the new tokens of all requests, request b owning rows qo_indptr[b]:qo_indptr[b+1]; o: (T, H, Dv)
    written in place (and returned). Request b attends to the slots kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    (cached prefix and its new tokens, already written to the pool) at absolute positions
    kv_positions_start[b] + j. A key is visible iff k_pos <= q_pos and (sliding_window <= 0 or
    q_pos - k_pos < sliding_window), with q_pos = q_positions[t]. Rows with no visible key get zeros.
    `max_extend_len` (longest qo segment) sizes the grid; when omitted it is read from qo_indptr (one sync).
    """
    group, head_dim_v = _check_pool_and_dims(q, k_buffer, v_buffer, o)
    num_tokens, num_heads, head_dim = q.shape
    if o.shape[0] != num_tokens:
        raise ValueError(f"o has {o.shape[0]} rows, q has {num_tokens}")
    if qo_indptr.dim() != 1 or qo_indptr.shape[0] < 1:
        raise ValueError(f"qo_indptr must have shape (B+1,), got {tuple(qo_indptr.shape)}")
    batch = qo_indptr.shape[0] - 1
    _check_index("qo_indptr", qo_indptr, batch + 1, q.device)
    _check_index("kv_indptr", kv_indptr, batch + 1, q.device)
    _check_index("kv_indices", kv_indices, None, q.device)
    _check_index("q_positions", q_positions, num_tokens, q.device)
    _check_index("kv_positions_start", kv_positions_start, batch, q.device)
    if batch == 0 or num_tokens == 0:
        return o
    if max_extend_len is None:
        max_extend_len = int((qo_indptr[1:] - qo_indptr[:-1]).max())
    if max_extend_len <= 0:
        return o

    if q.is_cuda:
        block_m, block_n, warps = (64, 64, 4) if head_dim <= 128 else (64, 32, 8)
    else:
        block_m, block_n, warps = 16, 16, 4
    grid = (triton.cdiv(max_extend_len, block_m), batch, num_heads)
    _extend_kernel[grid](
        q, k_buffer, v_buffer, o, qo_indptr, kv_indptr, kv_indices, q_positions, kv_positions_start,
        float(sm_scale), float(logit_cap), int(sliding_window),
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        o.stride(0), o.stride(1),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
        HAS_CAP=logit_cap > 0, HAS_WINDOW=sliding_window > 0,
        PRECISION=_precision(q.dtype), UPCAST=_upcast_dot(q.dtype),
        num_warps=warps, num_stages=2,
    )
    return o
