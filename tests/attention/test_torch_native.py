"""The torch backend's batched attention against a per-request, per-query reference in float64: mixed extend
lengths and cached prefixes, sliding windows, grouped KV heads, soft-capping, decode with unequal key lists."""

from types import SimpleNamespace

import pytest
import torch

from runtime.attention.sliding_window import to_index_list
from runtime.attention.torch_native import TorchNativeBackend

H, HKV, D, SLOTS = 4, 2, 16, 512


def _layer(window, softcap=None):
    return SimpleNamespace(num_heads=H, num_kv_heads=HKV, head_dim=D, scaling=D**-0.5, sliding_window=window,
                           logit_softcapping=softcap)


def _case(prefix_lens, extend_lens, window, dtype, seed):
    """Random KV buffers, each request's key slots (listed from its window start), q, and the backend."""
    gen = torch.Generator().manual_seed(seed)
    k_buf = torch.randn(SLOTS, HKV, D, generator=gen).to(dtype)
    v_buf = torch.randn(SLOTS, HKV, D, generator=gen).to(dtype)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    perm = torch.randperm(SLOTS - 1, generator=gen) + 1  # slot 0 is the sink
    tables, offset = [], 0
    for s in seq_lens:
        tables.append(perm[offset:offset + s])
        offset += s
    starts = [0 if window is None else max(0, p - window + 1) for p in prefix_lens]
    lens = [s - st for s, st in zip(seq_lens, starts)]
    keys = to_index_list(torch.cat([t[st:] for t, st in zip(tables, starts)]), starts, lens)
    q = torch.randn(sum(extend_lens), H, D, generator=gen).to(dtype)
    qo = [0]
    for e in extend_lens:
        qo.append(qo[-1] + e)
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)])
    backend = TorchNativeBackend(pool=None, req_to_token=None, sliding_window=window)
    backend.batch = SimpleNamespace(is_decode=all(e == 1 for e in extend_lens) and len(set(extend_lens)) == 1,
                                    prefix_lens=list(prefix_lens))
    backend.meta = SimpleNamespace(qo_list=qo, q_positions=positions.to(torch.int32))
    return backend, q, k_buf, v_buf, keys, tables, positions


def _reference(q, k_buf, v_buf, tables, prefix_lens, extend_lens, layer):
    out, row = [], 0
    group = H // HKV
    for table, p, e in zip(tables, prefix_lens, extend_lens):
        k = k_buf[table].double().repeat_interleave(group, dim=1)  # (S, H, D), key j at position j
        v = v_buf[table].double().repeat_interleave(group, dim=1)
        for i in range(e):
            pos = p + i
            scores = torch.einsum("hd,shd->hs", q[row].double(), k) * layer.scaling  # (H, S)
            if layer.logit_softcapping:
                scores = torch.tanh(scores / layer.logit_softcapping) * layer.logit_softcapping
            j = torch.arange(k.shape[0])
            visible = j <= pos
            if layer.sliding_window is not None:
                visible &= pos - j < layer.sliding_window
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out.append(torch.einsum("hs,shd->hd", probs, v))
            row += 1
    return torch.stack(out)  # (T, H, D)


CASES = {
    "fresh-single": ([0], [37]),
    "chunk-after-prefix": ([50], [20]),
    "mixed-batch": ([0, 33, 5, 0], [9, 1, 40, 23]),
    "decode-unequal": ([30, 7, 64], [1, 1, 1]),
    "decode-equal": ([12, 12], [1, 1]),
}


@pytest.mark.parametrize("softcap", [None, 30.0], ids=["sdpa", "softcap"])
@pytest.mark.parametrize("window", [None, 16], ids=["full", "window16"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_batched_attention_matches_per_query_reference(case, window, softcap):
    prefix_lens, extend_lens = CASES[case]
    backend, q, k_buf, v_buf, keys, tables, _ = _case(prefix_lens, extend_lens, window, torch.float32, seed=7)
    layer = _layer(window, softcap)
    got = backend.attend(q, k_buf, v_buf, keys, layer)
    assert got.shape == q.shape and got.dtype == q.dtype
    expected = _reference(q, k_buf, v_buf, tables, prefix_lens, extend_lens, layer)
    # NOTE: the soft-capped (explicit float32 matmul) path once differed by 7e-5 in a fresh-clone CI run on a
    # loaded 2-core Xeon with AMX, not reproduced in isolation since; its bound is 1e-4 until that is understood
    # (a wrong mask, window or head group is off by far more than that)
    tol = 1e-4 if softcap else 1e-5
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)


def test_bfloat16_inputs_are_attended_in_float32():
    prefix_lens, extend_lens = CASES["mixed-batch"]
    backend, q, k_buf, v_buf, keys, tables, _ = _case(prefix_lens, extend_lens, 16, torch.bfloat16, seed=3)
    layer = _layer(16)
    got = backend.attend(q, k_buf, v_buf, keys, layer)
    assert got.dtype == torch.bfloat16
    expected = _reference(q, k_buf, v_buf, tables, prefix_lens, extend_lens, layer)
    # only the output's rounding to bfloat16 separates them
    torch.testing.assert_close(got.double(), expected, rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("window", [None, 16], ids=["full", "window16"])
@pytest.mark.parametrize("case", ["decode-unequal", "decode-equal"])
def test_bfloat16_decode_runs_in_bfloat16_with_a_float32_softmax(case, window):
    prefix_lens, extend_lens = CASES[case]
    backend, q, k_buf, v_buf, keys, tables, _ = _case(prefix_lens, extend_lens, window, torch.bfloat16, seed=5)
    layer = _layer(window)
    got = backend.attend(q, k_buf, v_buf, keys, layer)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    expected = _reference(q, k_buf, v_buf, tables, prefix_lens, extend_lens, layer)
    # scores and probabilities rounded to bfloat16 on the way (as the reference implementation's eager path
    # does in bfloat16); a padded key attended, or a wrong group of heads, is off by far more
    torch.testing.assert_close(got.double(), expected, rtol=3e-2, atol=3e-2)


def test_the_plan_is_built_once_per_key_list_and_window():
    prefix_lens, extend_lens = CASES["mixed-batch"]
    backend, q, k_buf, v_buf, keys, _, _ = _case(prefix_lens, extend_lens, 16, torch.float32, seed=1)
    for _ in range(3):
        backend.attend(q, k_buf, v_buf, keys, _layer(16))
    assert len(backend._plans) == 1
    backend.attend(q, k_buf, v_buf, keys, _layer(None))  # a global layer over the same list: its own mask
    assert len(backend._plans) == 2


@pytest.mark.parametrize("window", [None, 16], ids=["full", "window16"])
@pytest.mark.parametrize("case", ["fresh-single", "chunk-after-prefix", "mixed-batch"])
def test_long_extends_are_attended_in_query_blocks_over_the_keys_each_block_can_see(case, window, monkeypatch):
    """With blocks of 8 query rows the plans cut the key table per block (fewer columns than the table for
    most blocks), and the output still equals the per-query reference."""
    import runtime.attention.torch_native as tn

    monkeypatch.setattr(tn, "QUERY_BLOCK", 8)
    prefix_lens, extend_lens = CASES[case]
    backend, q, k_buf, v_buf, keys, tables, _ = _case(prefix_lens, extend_lens, window, torch.float32, seed=11)
    layer = _layer(window)
    got = backend.attend(q, k_buf, v_buf, keys, layer)
    expected = _reference(q, k_buf, v_buf, tables, prefix_lens, extend_lens, layer)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    (plan,) = backend._plans.values()
    if plan.causal:  # a fresh single request within the window: the kernel's own causal path, no blocks
        assert plan.blocks is None and (window is None or max(extend_lens) <= window)
        return
    L = plan.slots.shape[1]
    assert plan.blocks and [b[0] for b in plan.blocks] == list(range(0, max(extend_lens), 8))
    assert sum(j1 - j0 for *_, j0, j1 in plan.blocks) < len(plan.blocks) * L  # masked columns skipped
