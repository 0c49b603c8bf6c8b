"""The fused CPU kernels (runtime/kernels) against the torch path they replace.

The norms round where the torch path rounds, so their bfloat16 outputs are the same bits but where the order of
float32 sums moves a value across a rounding boundary (one unit in the last place, rarely); attention is
held against float32 `scaled_dot_product_attention` over the gathered keys (the definition), in float32 to a
float32 tolerance and in bfloat16 to one rounding. The kernels are built here like at a server's start (about
30 s the first time on a machine).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from runtime import kernels
from runtime.layers.norm import rms_norm_scaled
from runtime.layers.rotary import RotaryEmbedding, apply_rotary


@pytest.fixture(scope="module")
def K():
    module = kernels.load()
    assert module is not None, f"the fused CPU kernels did not build: {kernels.failure()}"
    return module


@pytest.fixture(params=["amx", "bfloat16", "float32", "none"])
def tiles(request, K):
    """Extend attention's tiles of query rows on AMX-BF16, AVX512-BF16 or AVX2 (float32), or a token at a time
    (`set_extend_tiles`), each where this CPU runs it; then the fastest again."""
    try:
        K.set_extend_tiles(request.param)
    except RuntimeError as exc:
        pytest.skip(str(exc))
    assert K.extend_tiles() == request.param
    yield request.param
    K.set_extend_tiles("auto")


def _scale(*shape: int) -> torch.Tensor:
    return 1.0 + 0.2 * torch.randn(*shape)


@pytest.mark.parametrize("rows", [1, 3, 600])
def test_rms_norm_is_the_torch_paths_bits(K, rows):
    torch.manual_seed(rows)
    x = (3 * torch.randn(rows, 640)).bfloat16()
    scale = _scale(640)
    expected = rms_norm_scaled(x.float(), scale, 1e-6).bfloat16()  # float32 norm, one rounding: the torch path
    norm = K.rms_norm(x, scale, 1e-6, None)
    _same_but_rare_last_place(norm, expected)
    residual = torch.randn(rows, 640).bfloat16()
    assert torch.equal(K.rms_norm(x, scale, 1e-6, residual), residual + norm)  # torch's bfloat16 add of the norm


def _same_but_rare_last_place(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bits, but for at most 1 value in 10^4 one bfloat16 step away (float32 sums in another order)."""
    steps = (out.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
    assert steps.max() <= 1 and (steps > 0).sum() <= max(1, out.numel() // 10_000)


def test_rms_norm_per_head_scales(K):
    torch.manual_seed(1)
    x = torch.randn(2, 5, 256).bfloat16()
    scale = _scale(5, 256)
    expected = (torch.rms_norm(x.float(), (256,), None, 1e-6) * scale).bfloat16()
    _same_but_rare_last_place(K.rms_norm(x, scale, 1e-6, None), expected)


@pytest.mark.parametrize("tokens", [1, 7])
def test_qk_norm_rope_is_norm_then_rotation(K, tokens):
    torch.manual_seed(tokens)
    H, Hkv, D = 4, 1, 256
    qkv = torch.randn(tokens, (H + 2 * Hkv) * D).bfloat16()  # q heads, k heads, v heads
    scale = _scale(H + Hkv, D)
    cos, sin = RotaryEmbedding(D, 10_000.0, 4096).cos_sin(torch.randint(0, 4096, (tokens,)))
    qk = qkv[:, :(H + Hkv) * D].view(tokens, H + Hkv, D)
    expected = apply_rotary(rms_norm_scaled(qk, scale, 1e-6), cos, sin)
    _same_but_rare_last_place(K.qk_norm_rope(qkv, H + Hkv, scale, cos, sin, 1e-6), expected)


def _reference_attention(q, k_buf, v_buf, indices, lens, scaling):
    """Float32 SDPA per request over its gathered keys: (B, H, D)."""
    out, start = [], 0
    for n in lens:
        slots = indices[start:start + n].long()
        start += n
        if n == 0:
            out.append(torch.zeros(q.shape[1:]))
            continue
        k = k_buf[slots].float().transpose(0, 1)[None]  # (1, Hkv, n, D)
        v = v_buf[slots].float().transpose(0, 1)[None]
        qb = q[len(out)].float()[None, :, None, :]  # (1, H, 1, D)
        out.append(F.scaled_dot_product_attention(qb, k, v, scale=scaling, enable_gqa=True)[0, :, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[640], [3, 517], [1, 0, 64, 600, 2, 9, 33, 100]])
@pytest.mark.parametrize("heads", [(4, 1, 256), (8, 4, 128), (8, 1, 64), (3, 3, 32), (6, 3, 40)],
                         ids=["gemma3-270m", "2-per-kv-head", "8-per-kv-head", "1-per-kv-head", "head-dim-40"])
def test_decode_attention_matches_sdpa(K, dtype, lens, heads):
    """Every grouping of query heads the vector code has, and a head size it leaves to plain loops (40)."""
    torch.manual_seed(len(lens))
    S, (H, Hkv, D) = 2048, heads
    k_buf, v_buf = torch.randn(S, Hkv, D).to(dtype), torch.randn(S, Hkv, D).to(dtype)
    q = torch.randn(len(lens), H, D).to(dtype)
    indices = torch.randperm(S - 1)[:sum(lens)].add(1).int()  # distinct slots, in no order, the sink left out
    indptr = torch.tensor([0] + lens).cumsum(0).int()
    out = K.decode_attention(q, k_buf, v_buf, indices, indptr, 1 / 16, 0.0)
    expected = _reference_attention(q, k_buf, v_buf, indices, lens, 1 / 16)
    assert out.dtype == dtype and out.shape == q.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:  # float32 inside, one rounding of the output
        torch.testing.assert_close(out.float(), expected, rtol=2 ** -8, atol=1e-2)
    assert torch.equal(out[lens.index(0)], torch.zeros(H, D).to(dtype)) if 0 in lens else True


def test_decode_attention_far_apart_scores(K):
    """Scores tens apart: the exponentials of all but the largest underflow towards zero, as the scalar exp's."""
    torch.manual_seed(3)
    S, H, Hkv, D, n = 64, 4, 1, 256, 40
    k_buf, v_buf = torch.randn(S, Hkv, D), torch.randn(S, Hkv, D)
    q = 40 * torch.randn(1, H, D)
    indices = torch.arange(1, n + 1, dtype=torch.int32)
    out = K.decode_attention(q, k_buf, v_buf, indices, torch.tensor([0, n], dtype=torch.int32), 1.0, 0.0)
    torch.testing.assert_close(out, _reference_attention(q, k_buf, v_buf, indices, [n], 1.0), rtol=1e-5, atol=1e-5)


def _reference_extend(q, k_buf, v_buf, indices, kptr, starts, qptr, positions, window, scaling):
    """Each new token over the keys it sees, by float32 SDPA over exactly those keys: (T, H, D)."""
    out = torch.zeros(q.shape)
    for b in range(len(starts)):
        slots = indices[kptr[b]:kptr[b + 1]].long()
        key_pos = starts[b] + torch.arange(len(slots))
        for t in range(qptr[b], qptr[b + 1]):
            seen = (key_pos <= positions[t]) & ((positions[t] - key_pos < window) if window else True)
            k = k_buf[slots[seen]].float().transpose(0, 1)[None]  # (1, Hkv, n, D)
            v = v_buf[slots[seen]].float().transpose(0, 1)[None]
            qt = q[t].float()[None, :, None, :]
            out[t] = F.scaled_dot_product_attention(qt, k, v, scale=scaling, enable_gqa=True)[0, :, 0]
    return out


def _extend_case(K, requests, S, heads, dtype, window, scaling):
    """One extend over `requests`, each (key list start, keys, new tokens) with the new tokens the last of its list,
    at distinct random slots: the kernel's output and float32 SDPA's over the same keys."""
    H, Hkv, D = heads
    k_buf, v_buf = torch.randn(S, Hkv, D).to(dtype), torch.randn(S, Hkv, D).to(dtype)
    starts = [r[0] for r in requests]
    kptr, qptr, positions = [0], [0], []
    for start, n, new in requests:
        kptr.append(kptr[-1] + n)
        qptr.append(qptr[-1] + new)
        positions += list(range(start + n - new, start + n))
    indices = torch.randperm(S - 1)[:kptr[-1]].add(1).int()
    q = torch.randn(qptr[-1], H, D).to(dtype)
    as_int = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    out = K.extend_attention(q, k_buf, v_buf, indices, as_int(kptr), as_int(starts), as_int(qptr), as_int(positions),
                             window, scaling, 0.0)
    expected = _reference_extend(q, k_buf, v_buf, indices, kptr, starts, qptr, positions, window, scaling)
    assert out.dtype == dtype and out.shape == q.shape
    return out, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 8, 300])
@pytest.mark.parametrize("heads", [(4, 1, 256), (8, 4, 64), (6, 3, 40)], ids=["gemma3-270m", "2-per-kv-head", "head-dim-40"])
def test_extend_attention_sees_each_tokens_keys_only(K, tiles, dtype, window, heads):
    """Three requests in one extend: a fresh prompt, one with a cached prefix (its queries start past position 0),
    one whose key list starts at a window's edge; each new token sees its own position and before, and with a
    window only the last `window` keys."""
    torch.manual_seed(window)
    out, expected = _extend_case(K, [(0, 37, 37), (0, 350, 20), (40, 70, 9)], 1024, heads, dtype, window, 1 / 16)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), expected, rtol=2 ** -8, atol=1e-2)


@pytest.mark.parametrize("scaling", [1 / 16, 0.1], ids=["query-exact-in-bfloat16", "query-rounded"])
@pytest.mark.parametrize("window", [0, 512])
def test_extend_attention_of_long_prompts_in_tiles(K, tiles, scaling, window):
    """bfloat16 prompts longer than a window, many tiles of 16 query rows each (a prompt of 700, a cached prefix of 867
    with 33 new, a tail of 3 new tokens alone, a prompt whose tiles end part-filled), against float32 SDPA; a scaling
    that bfloat16 queries cannot take exactly goes the float32 way, and agrees as well."""
    torch.manual_seed(window + 1)
    requests = [(0, 700, 700), (0, 900, 33), (100, 650, 3), (5, 42, 42)]
    out, expected = _extend_case(K, requests, 4096, (4, 1, 256), torch.bfloat16, window, scaling)
    torch.testing.assert_close(out.float(), expected, rtol=2 ** -8, atol=1e-2)


def test_extend_attention_refuses_lists_that_do_not_fit(K):
    q, kv = torch.zeros(2, 2, 16), torch.zeros(8, 1, 16)
    as_int = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    with pytest.raises(RuntimeError, match="does not fit"):
        K.extend_attention(q, kv, kv, as_int([1, 2]), as_int([0, 2]), as_int([0]), as_int([0, 3]), as_int([0, 1]),
                           0, 1.0, 0.0)  # three query rows claimed, two given
    with pytest.raises(RuntimeError, match="outside the pool"):
        K.extend_attention(q, kv, kv, as_int([1, 9]), as_int([0, 2]), as_int([0]), as_int([0, 2]), as_int([0, 1]),
                           0, 1.0, 0.0)
    # bfloat16 tiles (a 16-row tile of 4 tokens by 4 heads) check the slots as they restage them
    q, kv = torch.zeros(4, 4, 64, dtype=torch.bfloat16), torch.zeros(8, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside the pool"):
        K.extend_attention(q, kv, kv, as_int([1, 2, 8, 3]), as_int([0, 4]), as_int([0]), as_int([0, 4]),
                           as_int([0, 1, 2, 3]), 0, 1 / 8, 0.0)


def test_decode_attention_soft_capping(K):
    torch.manual_seed(0)
    S, H, Hkv, D, n, cap = 256, 2, 2, 64, 50, 5.0
    k_buf, v_buf, q = torch.randn(S, Hkv, D), torch.randn(S, Hkv, D), 3 * torch.randn(1, H, D)
    indices = torch.arange(1, n + 1, dtype=torch.int32)
    out = K.decode_attention(q, k_buf, v_buf, indices, torch.tensor([0, n], dtype=torch.int32), 0.125, cap)
    scores = torch.einsum("hd,nhd->hn", q[0], k_buf[1:n + 1]) * 0.125
    probs = torch.softmax(torch.tanh(scores / cap) * cap, -1)
    torch.testing.assert_close(out[0], torch.einsum("hn,nhd->hd", probs, v_buf[1:n + 1]), rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused_with_a_message(K):
    k_buf = v_buf = torch.zeros(16, 1, 8)
    q = torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="outside the pool"):
        K.decode_attention(q, k_buf, v_buf, torch.tensor([3, 16], dtype=torch.int32),
                           torch.tensor([0, 2], dtype=torch.int32), 1.0, 0.0)
    with pytest.raises(RuntimeError, match="int32"):
        K.decode_attention(q, k_buf, v_buf, torch.tensor([3]), torch.tensor([0, 1]), 1.0, 0.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        K.decode_attention(q.bfloat16(), k_buf, v_buf, torch.tensor([3], dtype=torch.int32),
                           torch.tensor([0, 1], dtype=torch.int32), 1.0, 0.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        K.rms_norm(torch.zeros(2, 8, dtype=torch.float16), torch.ones(8), 1e-6, None)
    with pytest.raises(RuntimeError, match="scale"):
        K.rms_norm(torch.zeros(2, 8).bfloat16(), torch.ones(4), 1e-6, None)


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1000, 16384 * 2 + 5, 262144])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_row_argmax_is_torchs_max_with_the_first_index(K, vocab, rows):
    """Values and first indices as torch's `max(-1)`: ties at the start and the end of a row and across the
    threads' chunks, in the vector body and in the scalar tail."""
    g = torch.Generator().manual_seed(vocab * 10 + rows)
    x = torch.randn(rows, vocab, generator=g)
    if vocab > 2:
        top = x.max() + 1
        x[0, vocab // 2] = x[0, vocab - 1] = top  # the first of two wins, though the later one is in another chunk
        x[-1, 0] = x[-1, vocab - 1] = top
    values, index = K.row_argmax(x)
    expected = x.max(-1)
    assert torch.equal(values, expected.values) and torch.equal(index, expected.indices)


def test_row_argmax_of_non_finite_rows(K):
    x = torch.randn(4, 40000)
    x[0] = float("-inf")  # all -inf: the first index, as torch
    x[1, 30000] = float("inf")
    x[2, 39999] = float("nan")  # NaN in the last chunk's tail: the row's value is NaN
    x[3, 3] = float("nan")
    values, index = K.row_argmax(x)
    assert values[0] == float("-inf") and index[0] == 0
    assert values[1] == float("inf") and index[1] == 30000
    assert values[2:].isnan().all()
    assert torch.equal(index[:2], x[:2].max(-1).indices)
    empty = K.row_argmax(torch.zeros(0, 10))  # a batch that samples no row
    assert empty[0].shape == empty[1].shape == (0,)
    with pytest.raises(RuntimeError, match="float32"):
        K.row_argmax(x.bfloat16())
    with pytest.raises(RuntimeError, match="contiguous"):
        K.row_argmax(x.t())


def _load_in_subprocess(**env: str) -> list[str]:
    code = ("from runtime import kernels; import torch; "
            "print(kernels.load() is None, kernels.for_tensor(torch.zeros(1).bfloat16()) is None); "
            "print(kernels.failure())")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True,
                         check=True, timeout=300).stdout
    return out.splitlines()


def test_switched_off_the_torch_path_serves_and_says_why():
    assert _load_in_subprocess(SWA_RUNTIME_CPU_KERNELS="off") == ["True True", "SWA_RUNTIME_CPU_KERNELS=off"]


def test_without_a_working_compiler_the_torch_path_serves_and_says_why(tmp_path):
    flag, why = _load_in_subprocess(SWA_RUNTIME_CACHE_DIR=str(tmp_path), CXX="/bin/false")
    assert flag == "True True" and "Error" in why, why


def test_an_unwritable_cache_is_a_reason_not_a_crash(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # the cache "directory" is a file: nothing can be made under it
    flag, why = _load_in_subprocess(SWA_RUNTIME_CACHE_DIR=str(blocker))
    assert flag == "True True" and "Error" in why, why


_LOAD_LOGGED = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr); "
                "from runtime import kernels; print(kernels.load() is not None, kernels.failure())")


def _built_dir() -> Path:
    from runtime.paths import cache_dir

    return cache_dir() / "kernels" / kernels._build_name()


def test_a_lock_left_by_a_killed_build_is_removed_not_waited_on(K):
    """torch's `lock` file from a build killed half-way: the next start takes it as stale and loads (before, it
    waited on it forever)."""
    stale = _built_dir() / "lock"
    stale.write_text("")
    try:
        run = subprocess.run([sys.executable, "-c", _LOAD_LOGGED], capture_output=True, text=True, timeout=240)
    finally:
        left = stale.exists()
        stale.unlink(missing_ok=True)
    assert run.stdout.split() == ["True", "None"], run.stderr
    assert not left and "left by a kernel build that was killed" in run.stderr, run.stderr


def test_a_build_in_progress_is_waited_for_and_its_lock_kept(K):
    """While another process holds the build (its OS lock and torch's `lock` file), a start waits and says so; it
    loads once that build ends, and never removed the live build's file."""
    import fcntl

    build_dir = _built_dir()
    live = build_dir / "lock"
    with open(build_dir / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        live.write_text("")
        child = subprocess.Popen([sys.executable, "-c", _LOAD_LOGGED], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        try:
            said = child.stderr.readline()
            assert "waiting for another process building" in said, said
            assert live.exists() and child.poll() is None
        finally:
            live.unlink(missing_ok=True)  # the build "ends": torch's file first, then the OS lock
    out, err = child.communicate(timeout=240)
    assert out.split() == ["True", "None"], err
    assert "killed" not in err, err


def _quantised_blocks(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) per block of `block` values as the kernels quantise it: (int8 values (M, K/block, block) as
    float, scales (M, K/block, 1)), symmetric, round half to even."""
    M, K = x.shape
    xb = x.float().view(M, K // block, block)
    top = xb.abs().amax(-1, keepdim=True)
    inverse = torch.full_like(top, 127.0) / top  # a true division (`127 / top` multiplies by a reciprocal)
    return torch.round(xb * torch.where(top > 0, inverse, torch.zeros_like(top))), top / 127


def _blockwise_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x quantised per block times int8 q (N, K), in exact integer sums per block, then the two scales: what
    the int8 kernel computes, written out in torch."""
    M, K = x.shape
    xq, xs = _quantised_blocks(x)
    dots = torch.einsum("mbk,nbk->mnb", xq.double(), q.view(q.shape[0], K // 32, 32).double())  # exact integers
    return (dots * xs.double().view(M, 1, -1)).sum(-1) * scales.double()  # (M, N)


def _blockwise_int4_reference(x: torch.Tensor, q: torch.Tensor, step: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """W = low + step * q per group of 32: the quantised blocks of x times q in exact integer sums, scaled by each
    group's step, plus each group's offset times the sum of the block's own values: the int4 kernel's arithmetic."""
    M, K = x.shape
    xq, xs = _quantised_blocks(x)
    dots = torch.einsum("mbk,nbk->mnb", xq.double(), q.view(q.shape[0], K // 32, 32).double())
    sums = x.double().view(M, 1, K // 32, 32).sum(-1)  # (M, 1, B)
    return (dots * xs.double().view(M, 1, -1) * step.double()[None] + sums * low.double()[None]).sum(-1)


def _int4_weight(N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.int32)
    step = torch.rand(N, K // 32, generator=gen) / 50
    low = -8 * step + torch.randn(N, K // 32, generator=gen) / 100
    return q, step, low


@pytest.fixture(scope="module")
def low_bit(K):
    if not K.has_low_bit():
        pytest.skip("this CPU has neither AVX512-VNNI nor AVX2: the decode copies use torch's kernels")
    return K


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 8, 9, 38, 101])  # up to 8 streamed, more in tiles
def test_int8_projection_is_blockwise_int8_arithmetic(low_bit, rows):
    torch.manual_seed(rows)
    N, Kd = 80, 640  # 5 groups of 16 rows: the tiles' 3 and an edge of 2
    q = torch.randint(-127, 128, (N, Kd), dtype=torch.int8)
    scales = torch.rand(N) / 100
    x = torch.randn(rows, Kd)
    x[0, :32] = 0  # an all-zero block: scale 0, no division by it
    weight = low_bit.Projection.int8(q, scales)
    assert (weight.format, weight.out_features, weight.in_features) == ("int8", N, Kd)
    assert weight.nbytes == N * Kd + 4 * N
    out = weight.matmul(x)
    torch.testing.assert_close(out.double(), _blockwise_reference(x, q, scales), rtol=1e-5, atol=1e-5)
    out16 = weight.matmul(x.bfloat16())
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.double(), _blockwise_reference(x.bfloat16(), q, scales), rtol=2 ** -8, atol=1e-3)
    wide = weight.matmul(x.bfloat16(), float_out=True)  # the LM head's logits: no rounding to bfloat16
    assert wide.dtype == torch.float32
    torch.testing.assert_close(wide.double(), _blockwise_reference(x.bfloat16(), q, scales), rtol=1e-5, atol=1e-5)
    # and close to the unquantised product: the activations' blocks cost about 0.5% (relative norm)
    exact = x.double() @ (q.double() * scales.double()[:, None]).T
    assert (out.double() - exact).norm() / exact.norm() < 0.02


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 38])
def test_int8_projection_with_a_scale_per_block(low_bit, rows):
    """int8 values with a scale per row and block of 32 (a Q5_0 or Q8_0 tensor): the block sums scaled by the
    weight's block scale and the activations'."""
    torch.manual_seed(rows)
    N, Kd = 48, 256
    q = torch.randint(-127, 128, (N, Kd), dtype=torch.int8)
    scales = (torch.rand(N, Kd // 32) / 100).half().float()  # float16 values, as a GGUF's
    x = torch.randn(rows, Kd)
    weight = low_bit.Projection.int8(q, scales)
    assert weight.format == "int8-block" and weight.nbytes == N * Kd + 2 * N * Kd // 32  # 8.5 bits a weight
    xq, xs = _quantised_blocks(x)
    dots = torch.einsum("mbk,nbk->mnb", xq.double(), q.view(N, -1, 32).double())
    expected = (dots * xs.double().view(rows, 1, -1) * scales.double()[None]).sum(-1)
    torch.testing.assert_close(weight.matmul(x).double(), expected, rtol=1e-5, atol=1e-5)
    exact = x.double() @ (q.double() * scales.double().repeat_interleave(32, 1)).T
    assert (weight.matmul(x).double() - exact).norm() / exact.norm() < 0.02


def _wide_bytes(low_bit) -> int:
    """Bytes a wide copy keeps a weight in: AVX2 stores each line's magnitudes beside its values."""
    return 2 if low_bit.low_bit_isa() == "avx2" else 1


def _wide_weight(N: int, K: int, seed: int, largest: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(-largest, largest + 1, (N, K), generator=gen, dtype=torch.int8),
            torch.rand(N, K // 128, generator=gen) / 100 + 1e-4)


@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 38, 101])  # up to 8 streamed, more in tiles
def test_int8_wide_projection_is_blockwise_arithmetic_in_blocks_of_128(low_bit, rows, paired):
    """int8 values with a float32 scale per row and block of 128, the activations quantised per 128 values too:
    each block's integer sum scaled once by both scales. Weights within -64..64 make a paired copy (every four
    values of one 16-bit sum within PAIR_BUDGET), which the AVX2 tiles take two lines a step."""
    torch.manual_seed(rows)
    N, Kd = 80, 640  # 5 groups of 16 rows (the tiles' 3 and an edge of 2), 5 blocks of 128
    q, scales = _wide_weight(N, Kd, rows, 64 if paired else 127)
    x = torch.randn(rows, Kd)
    x[0, :128] = 0  # an all-zero block: scale 0, no division by it
    weight = low_bit.Projection.int8_wide(q, scales)
    assert (weight.format, weight.out_features, weight.in_features) == ("int8-wide", N, Kd)
    assert weight.paired == paired
    assert weight.nbytes == _wide_bytes(low_bit) * N * Kd + 4 * N * Kd // 128 and not weight.has_tiles
    xq, xs = _quantised_blocks(x, 128)
    dots = torch.einsum("mbk,nbk->mnb", xq.double(), q.view(N, -1, 128).double())  # exact integers
    expected = (dots * xs.double().view(rows, 1, -1) * scales.double()[None]).sum(-1)
    torch.testing.assert_close(weight.matmul(x).double(), expected, rtol=1e-5, atol=1e-5)
    xq16, xs16 = _quantised_blocks(x.bfloat16(), 128)
    dots16 = torch.einsum("mbk,nbk->mnb", xq16.double(), q.view(N, -1, 128).double())
    expected16 = (dots16 * xs16.double().view(rows, 1, -1) * scales.double()[None]).sum(-1)
    torch.testing.assert_close(weight.matmul(x.bfloat16(), float_out=True).double(), expected16, rtol=1e-5, atol=1e-5)
    exact = x.double() @ (q.double() * scales.double().repeat_interleave(128, 1)).T
    assert (weight.matmul(x).double() - exact).norm() / exact.norm() < 0.02  # the activations' blocks only


@pytest.mark.parametrize("rows", [3, 38])  # streamed, in tiles
def test_a_smoothed_int8_wide_projection_quantises_its_rows_divided_by_the_smooth(low_bit, rows):
    """With `smooth` s (K,): each row times 1/s (the reciprocal, in float32), then the same blockwise arithmetic;
    q * scale is taken to hold W * s, so the product approximates x @ W^T."""
    torch.manual_seed(rows)
    N, Kd = 48, 256
    w = torch.randn(N, Kd) * 0.05
    x = torch.randn(rows, Kd).bfloat16()
    s = torch.rand(Kd) * 4 + 0.25
    q = torch.round(w * s / (w * s).abs().amax(1, keepdim=True) * 127).to(torch.int8)
    scales = ((w * s).abs().amax(1, keepdim=True) / 127).expand(N, Kd // 128).contiguous()
    weight = low_bit.Projection.int8_wide(q, scales, s)
    assert weight.smoothed and weight.nbytes == _wide_bytes(low_bit) * N * Kd + 4 * N * Kd // 128 + 4 * Kd  # + 1 / s
    xq, xs = _quantised_blocks(x.float() * s.reciprocal(), 128)
    dots = torch.einsum("mbk,nbk->mnb", xq.double(), q.view(N, -1, 128).double())
    expected = (dots * xs.double().view(rows, 1, -1) * scales.double()[None]).sum(-1)
    torch.testing.assert_close(weight.matmul(x, float_out=True).double(), expected, rtol=1e-5, atol=1e-5)
    exact = x.double() @ w.double().T
    assert (weight.matmul(x, float_out=True).double() - exact).norm() / exact.norm() < 0.1  # a random s: no gain
    plain = low_bit.Projection.int8_wide(q, scales)  # the same weight unsmoothed: s's columns not divided out
    assert not plain.smoothed and (plain.matmul(x, float_out=True).double() - exact).norm() / exact.norm() > 0.2
    own = low_bit.Projection.int8(q, torch.rand(N) / 100)
    own.set_tiles(weight)
    assert own.smoothed and own.nbytes == N * Kd + 4 * N  # its tiles' copy is; nbytes: its own


def test_a_smooth_must_be_one_positive_finite_float32_a_column(low_bit):
    q, scales = _wide_weight(16, 256, 0)
    for bad, match in ((torch.ones(255), r"float32 \(256,\) on the CPU"),
                       (torch.ones(256, dtype=torch.float64), "float32"),
                       (torch.zeros(256), "finite and positive"), (torch.full((256,), float("inf")), "finite"),
                       (-torch.ones(256), "positive"), (torch.full((256,), 1e-40), "finite reciprocals")):
        with pytest.raises(RuntimeError, match=match):
            low_bit.Projection.int8_wide(q, scales, bad)


def test_a_tiles_copy_takes_the_rows_past_eight_only(low_bit):
    """A projection with a tiles' copy: up to 8 rows on its own weight, more on the copy (and its blocks of 128),
    in `matmul` as in the fused layer calls; dropped, every row count on its own weight again."""
    torch.manual_seed(0)
    N, Kd = 48, 256
    q = torch.randint(-16, 16, (N, Kd), dtype=torch.int8)
    scales = (torch.rand(N, Kd // 32) / 100).half().float()
    own, alone = low_bit.Projection.int8(q, scales), low_bit.Projection.int8(q, scales)
    tiles = low_bit.Projection.int8_wide(*_wide_weight(N, Kd, 1))
    own.set_tiles(tiles)
    assert own.has_tiles and own.format == "int8-block" and own.nbytes == alone.nbytes  # nbytes: its own copy's
    for rows in (1, 8):
        x = torch.randn(rows, Kd).bfloat16()
        assert torch.equal(own.matmul(x), alone.matmul(x))
    for rows in (9, 40):
        x = torch.randn(rows, Kd).bfloat16()
        assert torch.equal(own.matmul(x), tiles.matmul(x)) and not torch.equal(own.matmul(x), alone.matmul(x))
    own.drop_tiles()
    assert not own.has_tiles and torch.equal(own.matmul(x), alone.matmul(x))


def test_a_tiles_copy_must_fit_and_blocks_of_128_must_divide(low_bit):
    q, scales = _wide_weight(48, 256, 0)
    own = low_bit.Projection.int8(q, torch.rand(48) / 100)
    with pytest.raises(RuntimeError, match="this weight's shape"):
        own.set_tiles(low_bit.Projection.int8_wide(*_wide_weight(32, 256, 0)))
    nested = low_bit.Projection.int8_wide(q, scales)
    nested.set_tiles(low_bit.Projection.int8_wide(q, scales))
    with pytest.raises(RuntimeError, match="not have one of its own"):
        own.set_tiles(nested)
    assert not own.has_tiles  # refused: nothing set
    with pytest.raises(RuntimeError, match="K of 128"):
        low_bit.Projection.int8_wide(torch.zeros(16, 96, dtype=torch.int8), torch.ones(16, 1))
    with pytest.raises(RuntimeError, match=r"float32 \(N, K / 128\)"):
        low_bit.Projection.int8_wide(q, torch.ones(48, 8))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 38, 101])
@pytest.mark.parametrize("half_scales", [False, True])
def test_int4_projection_uses_the_4bit_weight_exactly(low_bit, rows, half_scales):
    """float32 steps and offsets used as they are; with half_scales (a screen's coarse copy), as float16 rounds them."""
    N, Kd = 64, 512  # 4 groups: a tile of 3 and an edge of 1
    q, step, low = _int4_weight(N, Kd, rows)
    x = torch.randn(rows, Kd, generator=torch.Generator().manual_seed(rows))
    weight = low_bit.Projection.int4(q, step, low, half_scales=half_scales)
    if half_scales:
        assert not torch.equal(step.half().float(), step)  # the rounding is there to be seen
        step, low = step.half().float(), low.half().float()
    assert (weight.format, weight.out_features, weight.in_features) == (
        "int4-half" if half_scales else "int4", N, Kd)
    scale_bytes = 2 if half_scales else 4
    assert weight.nbytes == N * Kd // 2 + 2 * scale_bytes * N * Kd // 32  # half a byte a weight, a step and offset
    out = weight.matmul(x)
    torch.testing.assert_close(out.double(), _blockwise_int4_reference(x, q, step, low), rtol=1e-5, atol=1e-5)
    out16 = weight.matmul(x.bfloat16())
    torch.testing.assert_close(out16.double(), _blockwise_int4_reference(x.bfloat16(), q, step, low), rtol=2 ** -8,
                               atol=1e-3)
    dense = low.repeat_interleave(32, 1) + step.repeat_interleave(32, 1) * q  # the weight, in float32
    exact = x.double() @ dense.double().T
    assert (out.double() - exact).norm() / exact.norm() < 0.02  # the activations' blocks only


def _near_top_groups(y: torch.Tensor, margin: float) -> torch.Tensor:
    """(M, N / 16) bool: each row's groups of 16 columns holding a value within margin of that row's largest."""
    near = y >= y.max(dim=1, keepdim=True).values - margin  # (M, N)
    return near.view(y.shape[0], -1, 16).any(-1)


@pytest.mark.parametrize("rows", [1, 3, 8, 16])
@pytest.mark.parametrize("per_block", [True, False])
def test_refine_recomputes_the_groups_near_each_rows_top_exactly(low_bit, rows, per_block):
    """A screen's values (here unrelated to the weight, so that only refine's choice can make them right): the groups
    near a row's own top become `matmul`'s sums to the bit, every other value is left as it was, another row's near
    groups included."""
    torch.manual_seed(rows)
    N, Kd, margin = 16 * 256, 128, 0.5
    q = torch.randint(-127, 128, (N, Kd), dtype=torch.int8)
    scales = (torch.rand(N, Kd // 32) / 100).half().float() if per_block else torch.rand(N) / 100
    weight = low_bit.Projection.int8(q, scales)
    x = torch.randn(rows, Kd).bfloat16()
    exact = weight.matmul(x, float_out=True)
    screen = torch.randn(rows, N)
    chosen = _near_top_groups(screen, margin)
    assert (0 < chosen.sum(1)).all() and (chosen.sum(1) < N // 16 // 4).all()  # a few groups a row: taken one by one
    if rows > 1:
        assert (chosen.any(0) & ~chosen).any()  # some group near one row's top and not another's
    y = screen.clone()
    assert weight.refine(x, y, margin) == int(chosen.sum())
    expected = torch.where(chosen.repeat_interleave(16, 1), exact, screen)
    assert torch.equal(y, expected)


def test_refine_of_a_flat_row_is_the_whole_matmul(low_bit):
    torch.manual_seed(5)
    N, Kd = 16 * 32, 64
    weight = low_bit.Projection.int8(torch.randint(-127, 128, (N, Kd), dtype=torch.int8), torch.rand(N) / 100)
    x = torch.randn(2, Kd)
    y = torch.zeros(2, N)  # every value at the top: every group near it
    assert weight.refine(x, y, 0.0) == 2 * (N // 16)
    assert torch.equal(y, weight.matmul(x, float_out=True))


def test_refine_past_half_the_groups_recomputes_them_all(low_bit):
    """Most groups near the top (a flat row): all of them recomputed in order, the ones not near too."""
    torch.manual_seed(6)
    N, Kd = 16 * 64, 64
    weight = low_bit.Projection.int8(torch.randint(-127, 128, (N, Kd), dtype=torch.int8), torch.rand(N) / 100)
    x = torch.randn(1, Kd)
    y = torch.zeros(1, N)
    y[0, : N * 3 // 8] = -10.0  # 24 groups of 64 far below the top, 40 at it
    assert weight.refine(x, y, 1.0) == N // 16
    assert torch.equal(y, weight.matmul(x, float_out=True))


@pytest.mark.parametrize("flat_rows", [[0, 5, 11], list(range(2, 12))])  # fewer and more than the streaming kernel's 8
def test_refine_recomputes_flat_rows_whole_and_the_others_by_their_groups(low_bit, flat_rows):
    """A batch of rows, some flat: those come out as `matmul`'s whole rows, the others only near their own tops."""
    torch.manual_seed(len(flat_rows))
    N, Kd, M, margin = 16 * 128, 128, 12, 0.5
    weight = low_bit.Projection.int8(torch.randint(-127, 128, (N, Kd), dtype=torch.int8),
                                     (torch.rand(N, Kd // 32) / 100).half().float())
    x = torch.randn(M, Kd).bfloat16()
    exact = weight.matmul(x, float_out=True)
    screen = torch.randn(M, N)
    screen[flat_rows] = 0.0  # every group at the top
    chosen = _near_top_groups(screen, margin)
    peaked = [m for m in range(M) if m not in flat_rows]
    y = screen.clone()
    assert weight.refine(x, y, margin) == len(flat_rows) * (N // 16) + int(chosen[peaked].sum())
    assert torch.equal(y[flat_rows], exact[flat_rows])
    expected = torch.where(chosen.repeat_interleave(16, 1), exact, screen)
    assert torch.equal(y[peaked], expected[peaked])
    assert not torch.equal(y[peaked], exact[peaked])  # the peaked rows' far groups stay the screen's


def test_refine_refuses_what_it_cannot_take(low_bit):
    weight = low_bit.Projection.int8(torch.zeros(32, 64, dtype=torch.int8), torch.ones(32))
    with pytest.raises(RuntimeError, match="x must be"):
        weight.refine(torch.zeros(1, 32), torch.zeros(1, 32), 1.0)
    with pytest.raises(RuntimeError, match="y must be contiguous float32"):
        weight.refine(torch.zeros(1, 64), torch.zeros(1, 32).bfloat16(), 1.0)
    with pytest.raises(RuntimeError, match="y must be contiguous float32"):
        weight.refine(torch.zeros(1, 64), torch.zeros(1, 16), 1.0)
    with pytest.raises(RuntimeError, match="margin"):
        weight.refine(torch.zeros(1, 64), torch.zeros(1, 32), -1.0)
    for half_scales in (False, True):
        int4 = low_bit.Projection.int4(torch.zeros(32, 64, dtype=torch.int32), torch.ones(32, 2), torch.zeros(32, 2),
                                    half_scales=half_scales)
        with pytest.raises(RuntimeError, match="int8 weight"):
            int4.refine(torch.zeros(1, 64), torch.zeros(1, 32), 1.0)


def test_projections_refuse_what_they_cannot_pack_or_take(low_bit):
    with pytest.raises(RuntimeError, match="multiple of 16"):
        low_bit.Projection.int8(torch.zeros(10, 64, dtype=torch.int8), torch.ones(10))
    with pytest.raises(RuntimeError, match="int8"):
        low_bit.Projection.int8(torch.zeros(16, 64), torch.ones(16))
    with pytest.raises(RuntimeError, match="scales"):
        low_bit.Projection.int8(torch.zeros(16, 64, dtype=torch.int8), torch.ones(15))
    with pytest.raises(RuntimeError, match="float16 values.*got 0.1"):
        low_bit.Projection.int8(torch.zeros(16, 64, dtype=torch.int8), torch.full((16, 2), 0.1))  # not a float16
    with pytest.raises(RuntimeError, match="0..15"):
        low_bit.Projection.int4(torch.full((16, 64), 16, dtype=torch.int32), torch.ones(16, 2), torch.zeros(16, 2))
    with pytest.raises(RuntimeError, match="step"):
        low_bit.Projection.int4(torch.zeros(16, 64, dtype=torch.int32), torch.ones(16, 3), torch.zeros(16, 2))
    with pytest.raises(RuntimeError, match="65504"):
        low_bit.Projection.int4(torch.zeros(16, 64, dtype=torch.int32), torch.full((16, 2), 7e4), torch.zeros(16, 2),
                             half_scales=True)
    weight = low_bit.Projection.int8(torch.zeros(16, 64, dtype=torch.int8), torch.ones(16))
    with pytest.raises(RuntimeError, match=r"must be \(M, 64\)"):
        weight.matmul(torch.zeros(1, 32))  # not the weight's width


def test_write_kv_is_an_index_put_of_both_rows(K):
    torch.manual_seed(0)
    k_buf, v_buf = torch.zeros(32, 2, 16).bfloat16(), torch.zeros(32, 2, 16).bfloat16()
    rows = torch.randn(3, 5, 16).bfloat16()  # k heads and v heads interleaved in a wider row, as qkv holds them
    k, v = rows[:, 1:3], rows[:, 3:5]
    loc = torch.tensor([7, 0, 31])
    expected_k, expected_v = k_buf.clone(), v_buf.clone()
    expected_k[loc], expected_v[loc] = k, v
    K.write_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(k_buf, expected_k) and torch.equal(v_buf, expected_v)
    with pytest.raises(RuntimeError, match="outside the pool"):
        K.write_kv(k_buf, v_buf, torch.tensor([32]), k[:1], v[:1])
    K.write_kv(k_buf, v_buf, torch.tensor([5], dtype=torch.int32), k[:1], v[:1])  # SWA locations: int32
    assert torch.equal(k_buf[5], k[0]) and torch.equal(v_buf[5], v[0])
    with pytest.raises(RuntimeError, match="int64 or int32"):
        K.write_kv(k_buf, v_buf, loc.float(), k, v)


def _int8_weight(N: int, K: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8), torch.rand(N, generator=gen) / (20 * K**0.5)


def _torch_norm(x: torch.Tensor, scale: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path's bfloat16 RMSNorm: float32 arithmetic, one rounding, then torch's bfloat16 add."""
    norm = rms_norm_scaled(x.float(), scale, 1e-6).bfloat16()
    return norm if residual is None else residual + norm


def _mostly_same_bits(out: torch.Tensor, expected: torch.Tensor) -> None:
    """A fused call against the torch path's operations on the same kernels: the same values but where a norm's
    float32 sum in another order crosses a rounding and moves what the next kernel quantises (rarely)."""
    torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -6, atol=2e-2)
    assert (out != expected).float().mean() < 0.01


@pytest.mark.parametrize("rows", [1, 5])
def test_layer_pre_is_norm_projection_then_qk_norm_and_rotation(low_bit, rows):
    torch.manual_seed(rows)
    hidden, H, Hkv, D = 640, 4, 1, 256
    qkv = low_bit.Projection.int8(*_int8_weight((H + 2 * Hkv) * D, hidden, 0))
    h = (4 * torch.randn(rows, hidden)).bfloat16()
    norm_scale, qk_scale = _scale(hidden), _scale(H + Hkv, D)
    cos, sin = RotaryEmbedding(D, 10_000.0, 4096).cos_sin(torch.randint(0, 4096, (rows,)))
    q, k, v = low_bit.layer_pre(h, norm_scale, qkv, qk_scale, H, Hkv, cos, sin, 1e-6)
    projected = qkv.matmul(_torch_norm(h, norm_scale))
    qk = apply_rotary(_torch_norm(projected[:, :(H + Hkv) * D].view(rows, H + Hkv, D), qk_scale), cos, sin)
    assert q.shape == (rows, H, D) and k.shape == (rows, Hkv, D) and v.shape == (rows, Hkv, D)
    _mostly_same_bits(q, qk[:, :H])
    _mostly_same_bits(k, qk[:, H:])
    _mostly_same_bits(v, projected[:, (H + Hkv) * D:].view(rows, Hkv, D))


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("down_format", ["int4", "int8"])
def test_layer_post_is_the_torch_paths_operations(low_bit, rows, down_format):
    torch.manual_seed(rows)
    hidden, width, inter = 640, 1024, 2048
    o = low_bit.Projection.int4(*_int4_weight(hidden, width, 1))
    gate_up = low_bit.Projection.int8(*_int8_weight(2 * inter, hidden, 2))
    down = (low_bit.Projection.int4(*_int4_weight(hidden, inter, 3)) if down_format == "int4"
            else low_bit.Projection.int8(*_int8_weight(hidden, inter, 3)))
    h, attn = (8 * torch.randn(rows, hidden)).bfloat16(), torch.randn(rows, width).bfloat16()
    scales = [_scale(hidden) for _ in range(3)]
    out = low_bit.layer_post(h, attn, o, scales[0], scales[1], gate_up, down, scales[2], 1e-6)
    h1 = _torch_norm(o.matmul(attn), scales[0], residual=h)
    gate, up = gate_up.matmul(_torch_norm(h1, scales[1])).chunk(2, dim=-1)
    expected = _torch_norm(down.matmul(F.gelu(gate, approximate="tanh") * up), scales[2], residual=h1)
    assert out.shape == h.shape and out.dtype == torch.bfloat16
    _mostly_same_bits(out, expected)


def test_fused_layer_calls_refuse_shapes_that_do_not_chain(low_bit):
    w = low_bit.Projection.int8(*_int8_weight(64, 64, 0))
    h, s = torch.zeros(1, 64).bfloat16(), torch.ones(64)
    with pytest.raises(RuntimeError, match="do not chain"):
        low_bit.layer_post(h, torch.zeros(1, 64).bfloat16(), w, s, s, w, w, s, 1e-6)  # gate_up must be twice down's width
    with pytest.raises(RuntimeError, match="T >= 1"):  # rows past eight run in tiles; none is refused
        low_bit.layer_pre(torch.zeros(0, 64).bfloat16(), s, w, torch.ones(3, 16), 1, 1, torch.ones(0, 16),
                       torch.ones(0, 16), 1e-6)


@pytest.mark.parametrize("rows, width", [(1, 2048), (8, 2048), (300, 2048), (5, 59)])
def test_gelu_and_mul_is_torchs_two_operations(K, rows, width):
    """The same bits wherever the product is not tiny; below 1e-2 the GELU's tail (where 1 + tanh cancels,
    in torch's float32 as in ours) may differ by a few millionths. A width of 59 runs every loop of the vector
    code: 32 values at a time, then 8, then one."""
    torch.manual_seed(rows)
    gate_up = (3 * torch.randn(rows, 2 * width)).bfloat16()
    with torch.no_grad():
        expected = F.gelu(gate_up[:, :width], approximate="tanh") * gate_up[:, width:]
    out = K.gelu_and_mul(gate_up)
    assert out.shape == (rows, width) and out.dtype == torch.bfloat16
    clear = expected.float().abs() > 1e-2
    assert torch.equal(out[clear], expected[clear])
    assert (out.float() - expected.float()).abs().max() < 1e-5
    odd = torch.randn(3, 2 * 20)  # a width the vector code does not divide: the plain loop, float32
    torch.testing.assert_close(K.gelu_and_mul(odd), F.gelu(odd[:, :20], approximate="tanh") * odd[:, 20:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gelu_and_mul_keeps_torchs_nan_and_infinities(K, dtype):
    """NaN in, NaN out; GELU(+inf) = +inf and GELU(-inf) = NaN (-inf * 0), as torch gives, in every loop; +-1e30,
    whose cube overflows float32 inside the GELU, come out as torch's."""
    gate_up = torch.ones(2, 2 * 59)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30])
    gate_up[:, [0, 9, 31, 35, 58]] = special  # the 32-wide loop, the 8-wide one and the last value alone
    gate_up[1, 59 + 3] = float("nan")  # an `up` value
    gate_up = gate_up.to(dtype)
    with torch.no_grad():
        expected = F.gelu(gate_up[:, :59], approximate="tanh") * gate_up[:, 59:]
    out = K.gelu_and_mul(gate_up)
    assert expected.isnan().sum() == 5 and expected.isinf().sum() == 2  # the cases above are all exercised
    torch.testing.assert_close(out, expected, equal_nan=True)


def test_decode_attention_with_a_scaling_bfloat16_cannot_hold(K):
    """A scaling that is no power of two makes q * scaling inexact in bfloat16: the float32 products serve (the
    bfloat16 dot products only take a query bfloat16 holds exactly)."""
    torch.manual_seed(5)
    S, H, Hkv, D, n = 128, 4, 1, 256, 100
    k_buf, v_buf, q = (torch.randn(S, Hkv, D).bfloat16(), torch.randn(S, Hkv, D).bfloat16(),
                       torch.randn(1, H, D).bfloat16())
    indices = torch.arange(1, n + 1, dtype=torch.int32)
    out = K.decode_attention(q, k_buf, v_buf, indices, torch.tensor([0, n], dtype=torch.int32), 0.1, 0.0)
    expected = _reference_attention(q, k_buf, v_buf, indices, [n], 0.1)
    torch.testing.assert_close(out.float(), expected, rtol=2 ** -8, atol=2e-3)


def _quads_at(first: list[int], second: list[int], N: int, K: int) -> torch.Tensor:
    """(N, K) int8: every 8 values of a row 8i + {0, 1, 4, 5} = first, 8i + {2, 3, 6, 7} = second (the two fours
    one 16-bit sum of the AVX2 tiles holds each), signs at random."""
    pattern = torch.tensor([first[0], first[1], second[0], second[1], first[2], first[3], second[2], second[3]])
    signs = torch.where(torch.rand(N, K, generator=torch.Generator().manual_seed(K)) < 0.5, -1, 1)
    return (pattern.repeat(N, K // 8) * signs).to(torch.int8)


@pytest.mark.parametrize("rows", [9, 38])  # in tiles
def test_a_paired_copy_at_its_budget_sums_exactly(low_bit, rows):
    """Four values adding up to PAIR_BUDGET (258) in every 16-bit sum against activations at +-127 whose signs match
    the weights' (row 0): each sum 258 * 127 = 32766, one below where 16 bits wrap. The output is the exact
    blockwise reference; one four at 259 and the copy is not paired (and still exact, a line a step)."""
    N, Kd = 32, 256
    assert low_bit.PAIR_BUDGET == 258
    scales = torch.full((N, Kd // 128), 1e-3)
    x = torch.where(torch.rand(rows, Kd, generator=torch.Generator().manual_seed(rows)) < 0.5, -1.0, 1.0)
    for q, paired in ((_quads_at([127, 127, 2, 2], [64, 64, 65, 65], N, Kd), True),
                      (_quads_at([127, 127, 2, 2], [64, 64, 65, 66], N, Kd), False)):
        x[0] = torch.sign(q[0].float())  # every product of row 0 with output 0 at +127 * |w|
        weight = low_bit.Projection.int8_wide(q, scales)
        assert weight.paired == paired
        xq, xs = _quantised_blocks(x, 128)
        dots = torch.einsum("mbk,nbk->mnb", xq.double(), q.view(N, -1, 128).double())
        expected = (dots * xs.double().view(rows, 1, -1) * scales.double()[None]).sum(-1)
        out = weight.matmul(x)
        torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)
        assert out[0, 0].item() == pytest.approx(float(q[0].abs().sum()) * 1e-3, rel=1e-6)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 9, 38])  # streamed, and in tiles (on AVX2 from 7)
def test_a_narrow_block_copy_at_its_bound_sums_exactly(low_bit, rows):
    """Weights of magnitude NARROW_MAX (16), output 0's all at +16, against activations all at +127 (row 0) and all
    at -127 (row 1): the AVX2 kernels take w + 16 (32) and add four lines' 8 products a lane in 16 bits, +-32512,
    below where 16 bits wrap. The output is the exact blockwise reference; one weight at 17 and the copy is not
    narrow (and still exact, a line a widening)."""
    N, Kd = 32, 256
    assert low_bit.NARROW_MAX == 16
    gen = torch.Generator().manual_seed(rows)
    signs = torch.where(torch.rand(N, Kd, generator=gen) < 0.5, -1, 1)
    scales = torch.full((N, Kd // 32), 2.0 ** -10)  # a float16 value, as a GGUF's
    x = torch.where(torch.rand(rows, Kd, generator=gen) < 0.5, -1.0, 1.0)
    signs[0] = 1
    x[0] = 1.0  # every product of row 0 with output 0 at +127 * 16 (as w + 16: 127 * 32)
    if rows > 1:
        x[1] = -1.0  # and of row 1 at -127 * 16
    for top, narrow in ((16, True), (17, False)):
        q = (16 * signs).to(torch.int8)
        q[5, 77] = top * signs[5, 77]
        weight = low_bit.Projection.int8(q, scales)
        assert weight.narrow == narrow
        xq, xs = _quantised_blocks(x)
        dots = torch.einsum("mbk,nbk->mnb", xq.double(), q.view(N, -1, 32).double())
        expected = (dots * xs.double().view(rows, 1, -1) * scales.double()[None]).sum(-1)
        out = weight.matmul(x)
        torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)
        assert out[0, 0].item() == pytest.approx(16 * Kd * 2.0 ** -10, rel=1e-6)
        if rows > 1:
            assert out[1, 0].item() == pytest.approx(-16 * Kd * 2.0 ** -10, rel=1e-6)


@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 9, 38])  # streamed, and in tiles (on AVX2 from 8)
def test_int4_extremes_sum_a_block_in_16_bits_exactly(low_bit, rows):
    """Every 4-bit value at 15 against activations at +-127, the signs constant over blocks: the AVX2 kernels add a
    block's 16 products a lane in 16 bits before widening, 16 * 15 * 127 = 30480 at most. Exact against the
    blockwise reference (the offsets' part included)."""
    N, Kd = 32, 256
    q = torch.full((N, Kd), 15, dtype=torch.int32)
    step = torch.full((N, Kd // 32), 2.0 ** -8)
    low = torch.full((N, Kd // 32), -2.0 ** -5)
    gen = torch.Generator().manual_seed(rows)
    x = torch.where(torch.rand(rows, Kd // 32, 1, generator=gen) < 0.5, -1.0, 1.0).expand(rows, Kd // 32, 32)
    x = x.reshape(rows, Kd).contiguous()
    for half_scales in (False, True):
        out = low_bit.Projection.int4(q, step, low, half_scales=half_scales).matmul(x)
        expected = _blockwise_int4_reference(x, q, step, low)
        torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)
        dense = (low + 15 * step).repeat_interleave(32, 1)
        torch.testing.assert_close(out.double(), x.double() @ dense.double().T, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 2, 5, 9])  # streamed and in tiles
def test_int8_extremes_neither_saturate_nor_flip_a_sign(low_bit, rows):
    """Weights at -128 and 127 against activations at +-127 in every position: the largest four-value sums either
    kernel forms (AVX2 adds pairs of products in 16 bits and negates activations by the weights' signs, where -128 has
    no positive twin). The integer sums must be exact: the output equals the reference to float32 rounding."""
    N, Kd = 32, 128
    gen = torch.Generator().manual_seed(rows)
    q = torch.where(torch.rand(N, Kd, generator=gen) < 0.5, -128, 127).to(torch.int8)
    q[0] = -128  # a row of -128 alone: every product's sign decided by the activation's
    x = torch.where(torch.rand(rows, Kd, generator=gen) < 0.5, -1.0, 1.0)  # quantised to exactly +-127
    x[0, 32:64] = -1.0  # a block whose pairs are all -127
    scales = torch.full((N,), 1e-3)
    out = low_bit.Projection.int8(q, scales).matmul(x)
    torch.testing.assert_close(out.double(), _blockwise_reference(x, q, scales), rtol=1e-6, atol=1e-6)
    assert out[0, 0].item() == pytest.approx(-128 * float(x[0].sum()) * 1e-3, rel=1e-6)
