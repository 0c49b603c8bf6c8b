"""Triton paged attention kernels against an independent pure-torch reference.

On CPU the kernels run under the Triton interpreter; shapes stay tiny. Every case scatters the KV of each
request over random pool slots (slot 0 is the padding sink and never used), so an indexing bug cannot hide
behind a contiguous layout.
"""

import math
import os

if not os.path.exists("/dev/nvidiactl"):  # as runtime/__init__.py: with a GPU the kernels compile for it
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, i.e. at import below

import pytest
import torch

import runtime.attention.triton_kernels as tk

if not torch.cuda.is_available() and not tk.interpreter_active():
    # Something imported triton before this module could switch the interpreter on; a silent skip would hide
    # the only kernel tests, so say how to fix it instead.
    raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set: export it, or set it in "
                       "tests/conftest.py before anything imports triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=5e-3, rtol=5e-3)}


# ---------------------------------------------------------------------------------------------- reference


def reference_attention(q_rows, k_buffer, v_buffer, slots, q_pos, k_pos, sm_scale, sliding_window=0,
                        logit_cap=0.0):
    """One request, straightforward loops in float64. q_rows: (n, H, D); slots/k_pos: (L,); q_pos: (n,)."""
    num_heads, num_kv_heads = q_rows.shape[1], k_buffer.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(q_rows.shape[0], num_heads, v_buffer.shape[2], dtype=torch.float64)
    keys = k_buffer[slots.long()].double()  # (L, Hkv, D)
    values = v_buffer[slots.long()].double()  # (L, Hkv, Dv)
    for i in range(q_rows.shape[0]):
        visible = [bool(kp <= q_pos[i]) and (sliding_window <= 0 or int(q_pos[i] - kp) < sliding_window)
                   for kp in k_pos.tolist()]
        if not any(visible):
            continue
        mask = torch.tensor(visible)
        for h in range(num_heads):
            kv_h = h // group
            scores = keys[:, kv_h] @ q_rows[i, h].double() * sm_scale  # (L,)
            if logit_cap > 0:
                scores = logit_cap * torch.tanh(scores / logit_cap)
            scores = scores.masked_fill(~mask, float("-inf"))
            out[i, h] = torch.softmax(scores, dim=0) @ values[:, kv_h]
    return out


# ---------------------------------------------------------------------------------------------- builders


def make_pool(num_slots, num_kv_heads, head_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_slots, num_kv_heads, head_dim, generator=g)
    v = torch.randn(num_slots, num_kv_heads, head_dim, generator=g)
    k[0] = 0.0  # the sink: any accidental use of slot 0 skews the result, never a crash
    v[0] = 0.0
    return k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE), g


def scatter_slots(lengths, num_slots, g):
    """Disjoint random slots (never 0) per request, in CSR form: (indptr, indices, per-request list)."""
    perm = torch.randperm(num_slots - 1, generator=g)[: sum(lengths)] + 1
    per_request = list(torch.split(perm.to(torch.int32), lengths))
    indptr = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return indptr.to(DEVICE), perm.to(torch.int32).to(DEVICE), per_request


# ---------------------------------------------------------------------------------------------- decode


def run_decode_case(lengths, num_heads, num_kv_heads, head_dim, dtype, seed, logit_cap=0.0, splits=None):
    k_buf, v_buf, g = make_pool(128, num_kv_heads, head_dim, dtype, seed)
    indptr, indices, per_req = scatter_slots(lengths, 128, g)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    o = torch.full_like(q, float("nan"))
    sm_scale = head_dim ** -0.5
    tk.decode_attention_fwd(q, k_buf, v_buf, o, indptr, indices, sm_scale, logit_cap, num_kv_splits=splits)
    for b, slots in enumerate(per_req):
        n = len(slots)
        expected = reference_attention(q[b:b + 1].cpu(), k_buf.cpu(), v_buf.cpu(), slots, torch.tensor([n - 1]),
                                       torch.arange(n), sm_scale, logit_cap=logit_cap)
        torch.testing.assert_close(o[b].cpu().double(), expected[0], **TOL[dtype])
    return o


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (4, 1)])
def test_decode_matches_reference(dtype, num_heads, num_kv_heads):
    run_decode_case([1, 5, 17, 40], num_heads, num_kv_heads, 32, dtype, seed=num_heads * 10 + num_kv_heads)


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_decode_split_count_does_not_change_result(splits):
    # 40 keys at BLOCK_N 16 span 3 tiles: 3 splits use one tile each, 8 splits leave most splits empty.
    run_decode_case([40, 17, 2], 4, 2, 16, torch.float32, seed=7, splits=splits)


def test_decode_logit_soft_cap():
    run_decode_case([5, 40], 4, 1, 16, torch.float32, seed=3, logit_cap=2.0)


def test_decode_empty_request_gives_zeros_and_neighbours_are_unaffected():
    k_buf, v_buf, g = make_pool(64, 1, 16, torch.float32, seed=11)
    indptr, indices, per_req = scatter_slots([5, 0, 3], 64, g)
    q = torch.randn(3, 2, 16, generator=g).to(DEVICE)
    o = torch.full_like(q, float("nan"))
    tk.decode_attention_fwd(q, k_buf, v_buf, o, indptr, indices, 0.25)
    assert torch.equal(o[1].cpu(), torch.zeros(2, 16))
    for b in (0, 2):
        n = len(per_req[b])
        expected = reference_attention(q[b:b + 1].cpu(), k_buf.cpu(), v_buf.cpu(), per_req[b],
                                       torch.tensor([n - 1]), torch.arange(n), 0.25)
        torch.testing.assert_close(o[b].cpu().double(), expected[0], **TOL[torch.float32])


def test_decode_empty_batch_is_a_no_op():
    k_buf, v_buf, _ = make_pool(8, 1, 16, torch.float32, seed=0)
    q = torch.empty(0, 2, 16, device=DEVICE)
    o = torch.empty(0, 2, 16, device=DEVICE)
    indptr = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    indices = torch.empty(0, dtype=torch.int32, device=DEVICE)
    assert tk.decode_attention_fwd(q, k_buf, v_buf, o, indptr, indices, 0.25) is o


def test_decode_reads_strided_q_and_o_views():
    # q and o as head-slices of wider (B, 2H, D) tensors, like a fused qkv projection's output.
    k_buf, v_buf, g = make_pool(64, 1, 16, torch.float32, seed=5)
    indptr, indices, per_req = scatter_slots([9, 4], 64, g)
    wide_q = torch.randn(2, 4, 16, generator=g).to(DEVICE)
    wide_o = torch.zeros(2, 4, 16, device=DEVICE)
    q, o = wide_q[:, 2:], wide_o[:, :2]
    tk.decode_attention_fwd(q, k_buf, v_buf, o, indptr, indices, 0.25)
    assert torch.equal(wide_o[:, 2:].cpu(), torch.zeros(2, 2, 16))
    for b, slots in enumerate(per_req):
        n = len(slots)
        expected = reference_attention(q[b:b + 1].cpu(), k_buf.cpu(), v_buf.cpu(), slots,
                                       torch.tensor([n - 1]), torch.arange(n), 0.25)
        torch.testing.assert_close(o[b].cpu().double(), expected[0], **TOL[torch.float32])


# ---------------------------------------------------------------------------------------------- extend


def run_extend_case(requests, num_heads, num_kv_heads, head_dim, dtype, seed, sliding_window=0,
                    logit_cap=0.0):
    """requests: (first kv position, cached keys, new tokens) each. The kv list covers the cached keys and the
    new tokens; the queries are the new tokens, at the last positions of that list."""
    k_buf, v_buf, g = make_pool(160, num_kv_heads, head_dim, dtype, seed)
    kv_lens = [cached + new for _, cached, new in requests]
    kv_indptr, kv_indices, per_req = scatter_slots(kv_lens, 160, g)
    new_lens = [new for _, _, new in requests]
    qo_indptr = torch.tensor([0] + list(torch.tensor(new_lens).cumsum(0)), dtype=torch.int32)
    starts = torch.tensor([first for first, _, _ in requests], dtype=torch.int32)
    q_pos = torch.cat([torch.arange(new, dtype=torch.int32) + first + cached
                       for first, cached, new in requests])
    q = torch.randn(sum(new_lens), num_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    o = torch.full_like(q, float("nan"))
    sm_scale = head_dim ** -0.5
    tk.extend_attention_fwd(q, k_buf, v_buf, o, qo_indptr.to(DEVICE), kv_indptr, kv_indices, q_pos.to(DEVICE),
                            starts.to(DEVICE), sm_scale, sliding_window, logit_cap)
    for b, (first, cached, new) in enumerate(requests):
        rows = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        expected = reference_attention(q[rows].cpu(), k_buf.cpu(), v_buf.cpu(), per_req[b], q_pos[rows],
                                       torch.arange(cached + new) + first, sm_scale, sliding_window, logit_cap)
        torch.testing.assert_close(o[rows].cpu().double(), expected, **TOL[dtype])
    return o


# (first kv position, cached prefix, new tokens): kv lengths 5, 17, 4, 40 (new-only, prefix+new, decode-like)
MIXED = [(0, 0, 5), (0, 12, 5), (0, 3, 1), (0, 23, 17)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (4, 1)])
def test_extend_causal_matches_reference(dtype, num_heads, num_kv_heads):
    run_extend_case(MIXED, num_heads, num_kv_heads, 16, dtype, seed=num_heads * 10 + num_kv_heads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [4, 8])
def test_extend_sliding_window_matches_reference(dtype, window):
    # The kv lists start long before every window, so the window mask removes most keys; one request's
    # list starts at position 30 (a caller that already trimmed out-of-window tokens).
    requests = MIXED + [(30, 6, 3)]
    o = run_extend_case(requests, 4, 2, 32, dtype, seed=window, sliding_window=window)
    full = run_extend_case(requests, 4, 2, 32, dtype, seed=window, sliding_window=0)
    assert (o - full).abs().max() > 0.1  # the window really changed the answer


def test_extend_float16_with_window():
    run_extend_case(MIXED, 4, 1, 16, torch.float16, seed=9, sliding_window=8)


def test_extend_logit_soft_cap_with_window():
    run_extend_case(MIXED, 2, 1, 16, torch.float32, seed=21, sliding_window=8, logit_cap=3.0)


def test_extend_request_without_new_tokens_and_rows_without_visible_keys():
    # Request 1 contributes no queries; request 2's list starts after its query position (nothing visible).
    k_buf, v_buf, g = make_pool(64, 1, 16, torch.float32, seed=13)
    kv_indptr, kv_indices, per_req = scatter_slots([6, 3, 4], 64, g)
    qo_indptr = torch.tensor([0, 2, 2, 3], dtype=torch.int32, device=DEVICE)
    q_pos = torch.tensor([4, 5, 1], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 0, 10], dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 2, 16, generator=g).to(DEVICE)
    o = torch.full_like(q, float("nan"))
    tk.extend_attention_fwd(q, k_buf, v_buf, o, qo_indptr, kv_indptr, kv_indices, q_pos, starts, 0.25)
    expected = reference_attention(q[:2].cpu(), k_buf.cpu(), v_buf.cpu(), per_req[0], q_pos[:2].cpu(),
                                   torch.arange(6), 0.25)
    torch.testing.assert_close(o[:2].cpu().double(), expected, **TOL[torch.float32])
    assert torch.equal(o[2].cpu(), torch.zeros(2, 16))


def test_extend_agrees_with_decode_on_the_last_token():
    # The same request seen as a 1-token extend and as a decode step must give the same row.
    k_buf, v_buf, g = make_pool(64, 2, 16, torch.float32, seed=17)
    kv_indptr, kv_indices, _ = scatter_slots([20], 64, g)
    q = torch.randn(1, 4, 16, generator=g).to(DEVICE)
    o_dec, o_ext = torch.zeros_like(q), torch.zeros_like(q)
    tk.decode_attention_fwd(q, k_buf, v_buf, o_dec, kv_indptr, kv_indices, 0.25)
    one = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    tk.extend_attention_fwd(q, k_buf, v_buf, o_ext, one, kv_indptr, kv_indices,
                            torch.tensor([19], dtype=torch.int32, device=DEVICE),
                            torch.zeros(1, dtype=torch.int32, device=DEVICE), 0.25)
    torch.testing.assert_close(o_dec, o_ext, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------- validation


def _decode_args(**overrides):
    k_buf, v_buf, _ = make_pool(8, 1, 16, torch.float32, seed=0)
    args = dict(q=torch.zeros(2, 2, 16, device=DEVICE), k_buffer=k_buf, v_buffer=v_buf,
                o=torch.zeros(2, 2, 16, device=DEVICE),
                kv_indptr=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
                kv_indices=torch.tensor([1, 2], dtype=torch.int32, device=DEVICE), sm_scale=0.25)
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides,error,match", [
    (dict(kv_indices=torch.tensor([1, 2])), TypeError, "kv_indices must be int32"),
    (dict(kv_indptr=torch.tensor([0, 2], dtype=torch.int32)), ValueError, r"kv_indptr must have shape \(3,\)"),
    (dict(q=torch.zeros(2, 3, 16), k_buffer=torch.zeros(8, 2, 16), v_buffer=torch.zeros(8, 2, 16)), ValueError,
     "multiple of kv heads"),
    (dict(q=torch.zeros(2, 2, 16, dtype=torch.bfloat16)), TypeError, "share a dtype"),
    (dict(o=torch.zeros(2, 2, 32)), ValueError, "o has shape"),
    (dict(q=torch.zeros(2, 2, 24), o=torch.zeros(2, 2, 24), k_buffer=torch.zeros(8, 1, 24),
          v_buffer=torch.zeros(8, 1, 24)), ValueError, "power of two"),
    (dict(k_buffer=torch.zeros(8, 1, 16, dtype=torch.int32)), TypeError, "float32, float16 or bfloat16"),
])
def test_decode_rejects_bad_inputs(overrides, error, match):
    overrides = {k: v.to(DEVICE) for k, v in overrides.items()}
    with pytest.raises(error, match=match):
        tk.decode_attention_fwd(**_decode_args(**overrides))


def test_extend_rejects_bad_position_tensors():
    k_buf, v_buf, _ = make_pool(8, 1, 16, torch.float32, seed=0)
    q = torch.zeros(2, 2, 16, device=DEVICE)
    ptr = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    idx = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    good_pos = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    start = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="q_positions must be int32"):
        tk.extend_attention_fwd(q, k_buf, v_buf, torch.zeros_like(q), ptr, ptr, idx, good_pos.long(), start, 0.25)
    with pytest.raises(ValueError, match=r"kv_positions_start must have shape \(1,\)"):
        tk.extend_attention_fwd(q, k_buf, v_buf, torch.zeros_like(q), ptr, ptr, idx, good_pos,
                                torch.zeros(2, dtype=torch.int32, device=DEVICE), 0.25)
    with pytest.raises(ValueError, match=r"q_positions must have shape \(2,\)"):
        tk.extend_attention_fwd(q, k_buf, v_buf, torch.zeros_like(q), ptr, ptr, idx, good_pos[:1], start, 0.25)


def test_reference_is_not_trivially_uniform():
    # Guard for the oracle itself: a sharper scale must change the reference output.
    k_buf, v_buf, g = make_pool(16, 1, 16, torch.float32, seed=1)
    q = torch.randn(1, 1, 16, generator=g)
    slots = torch.arange(1, 9, dtype=torch.int32)
    a = reference_attention(q, k_buf.cpu(), v_buf.cpu(), slots, torch.tensor([7]), torch.arange(8), 0.1)
    b = reference_attention(q, k_buf.cpu(), v_buf.cpu(), slots, torch.tensor([7]), torch.arange(8), 1.0)
    assert not torch.allclose(a, b, atol=1e-3)
    assert math.isclose(float(reference_attention(q, k_buf.cpu(), v_buf.cpu(), slots[:1], torch.tensor([0]),
                                                  torch.arange(1), 1.0)[0, 0, 0]), float(v_buf[1, 0, 0]),
                        rel_tol=1e-6)
