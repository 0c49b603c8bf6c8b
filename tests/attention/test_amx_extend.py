"""The AMX extend route (runtime/attention/amx_extend.py) attends what the kernels' extend_attention does: each
request's new tokens over its listed keys, causal, within the window; checked against a float64 softmax written
here and against the kernel, for fresh prompts, prompts with a prefix in the pool, windows and several requests,
the short ones among them attended by the kernel in a call of their own."""

import pytest
import torch

from runtime import kernels
from runtime.attention import amx_extend
from runtime.attention.sliding_window import KVIndexList

H, HKV, D, SLOTS = 4, 1, 64, 512


def _case(prefix: list[int], extend: list[int], window: int, seed: int = 0):
    """Pool buffers, queries and the key lists (what a window leaves, shuffled slots) for requests with
    `prefix` tokens already in the pool and `extend` new ones."""
    g = torch.Generator().manual_seed(seed)
    k_buf = torch.randn(SLOTS, HKV, D, generator=g).bfloat16()
    v_buf = torch.randn(SLOTS, HKV, D, generator=g).bfloat16()
    q = torch.randn(sum(extend), H, D, generator=g).bfloat16()
    free = torch.randperm(SLOTS - 1, generator=g) + 1
    indices, indptr, starts, used = [], [0], [], 0
    for p, e in zip(prefix, extend):
        start = 0 if not window else max(0, p - window + 1)
        n = p + e - start
        indices.append(free[used:used + n])
        used += n
        indptr.append(indptr[-1] + n)
        starts.append(start)
    keys = KVIndexList(indptr=torch.tensor(indptr, dtype=torch.int32),
                       indices=torch.cat(indices).to(torch.int32), start=torch.tensor(starts, dtype=torch.int32),
                       indptr_list=indptr, start_list=starts)
    qo = [0]
    for e in extend:
        qo.append(qo[-1] + e)
    return q, k_buf, v_buf, keys, qo


def _reference(q, k_buf, v_buf, keys, qo, prefix, window, scaling):
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(qo) - 1):
        slots = keys.indices[keys.indptr_list[b]:keys.indptr_list[b + 1]].long()
        k, v = k_buf[slots, 0].double(), v_buf[slots, 0].double()  # (L, D): one kv head
        for t in range(qo[b + 1] - qo[b]):
            pos = prefix[b] + t
            k_pos = keys.start_list[b] + torch.arange(len(slots))
            seen = (k_pos <= pos) & ((pos - k_pos < window) if window else True)
            scores = q[qo[b] + t].double() @ k[seen].T * scaling  # (H, seen)
            out[qo[b] + t] = torch.softmax(scores, -1) @ v[seen]
    return out


CASES = [  # (prefix, extend, window)
    ([0], [100], 0),  # a fresh prompt on a full layer: plain causal
    ([0], [100], 64),  # longer than the window: masked
    ([0], [64], 64),  # exactly the window: plain causal
    ([70], [80], 0),  # a prefix in the pool
    ([70], [80], 32),  # a prefix and a window that cuts into it
    ([0, 30, 0], [64, 90, 120], 48),  # several requests in one extend
    ([0, 90, 0, 5], [100, 10, 70, 1], 48),  # short requests among long ones: the kernel's, rows put back in place
    ([60, 0], [3, 80], 0),  # the short one first, on a full layer
]


def _positions(prefix: list[int], extend: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, extend)]).to(torch.int32)


@pytest.mark.parametrize("with_kernel", [False, True], ids=["alone", "short-on-kernel"])
@pytest.mark.parametrize("prefix,extend,window", CASES)
def test_each_query_sees_its_requests_keys_causally_and_within_the_window(prefix, extend, window, with_kernel):
    fused = kernels.load()
    if with_kernel and fused is None:
        pytest.skip(f"the fused CPU kernels are unavailable: {kernels.failure()}")
    q, k_buf, v_buf, keys, qo = _case(prefix, extend, window)
    positions = _positions(prefix, extend)
    got = amx_extend.extend_attention(q, k_buf, v_buf, keys, qo, positions, prefix, window, 0.125,
                                      fused if with_kernel else None)
    want = _reference(q, k_buf, v_buf, keys, qo, prefix, window, 0.125)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    # bfloat16 inputs and probabilities: within a few bfloat16 steps of values of order one
    assert (got.double() - want).abs().max() < 0.03
    if fused is not None:
        meta = torch.tensor(qo, dtype=torch.int32)
        theirs = fused.extend_attention(q, k_buf, v_buf, keys.indices, keys.indptr, keys.start, meta, positions,
                                        window, 0.125, 0.0)
        assert (got.double() - theirs.double()).abs().max() < 0.03


def test_the_short_requests_rows_come_from_the_kernel():
    """With the kernels given, a request under MIN_EXTEND new tokens is theirs: its rows are the kernel's bits."""
    fused = kernels.load()
    if fused is None:
        pytest.skip(f"the fused CPU kernels are unavailable: {kernels.failure()}")
    prefix, extend, window = [0, 90, 0], [100, 10, 3], 48
    q, k_buf, v_buf, keys, qo = _case(prefix, extend, window)
    positions = _positions(prefix, extend)
    got = amx_extend.extend_attention(q, k_buf, v_buf, keys, qo, positions, prefix, window, 0.125, fused)
    theirs = fused.extend_attention(q, k_buf, v_buf, keys.indices, keys.indptr, keys.start,
                                    torch.tensor(qo, dtype=torch.int32), positions, window, 0.125, 0.0)
    short = slice(qo[1], qo[3])
    assert torch.equal(got[short], theirs[short])
    assert not torch.equal(got[:qo[1]], theirs[:qo[1]])  # the long one is torch's: not the kernel's rounding


def test_a_batch_with_a_long_request_takes_the_route_and_soft_capping_or_float32_do_not(monkeypatch):
    q = torch.zeros(200, H, D, dtype=torch.bfloat16)
    monkeypatch.setattr(amx_extend, "CPU_HAS_AMX", False)
    assert not amx_extend.takes(q, [0, 100, 200], 0.0)  # no AMX: never
    monkeypatch.setattr(amx_extend, "CPU_HAS_AMX", True)  # the rule itself, on any CPU
    assert amx_extend.takes(q, [0, 100, 200], 0.0)
    assert amx_extend.takes(q, [0, 190, 200], 0.0)  # one long request is enough
    assert not amx_extend.takes(q, [0, 50, 100, 150, 200], 0.0)  # every request short: the kernel's call
    assert not amx_extend.takes(q, [0, 100, 200], 50.0)  # soft-capping: the kernel's explicit path
    assert not amx_extend.takes(q.float(), [0, 100, 200], 0.0)  # float32 keeps the exact path
