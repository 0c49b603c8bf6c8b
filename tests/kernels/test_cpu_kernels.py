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
def test_decode_attention_matches_sdpa(K, dtype, lens):
    torch.manual_seed(len(lens))
    S, H, Hkv, D = 2048, 4, 1, 256
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


def _blockwise_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (M, K) quantised per block of 32 (symmetric int8, round half to even), times int8 q (N, K), in exact
    integer sums per block, then the two scales: what the VNNI kernel computes, written out in torch."""
    M, K = x.shape
    xb = x.float().view(M, K // 32, 32)
    top = xb.abs().amax(-1, keepdim=True)
    inverse = torch.full_like(top, 127.0) / top  # a true division (`127 / top` multiplies by a reciprocal)
    xq = torch.round(xb * torch.where(top > 0, inverse, torch.zeros_like(top)))  # (M, B, 32), ties to even
    dots = torch.einsum("mbk,nbk->mnb", xq.double(), q.view(q.shape[0], K // 32, 32).double())  # exact integers
    return (dots * (top / 127).double().view(M, 1, -1)).sum(-1) * scales.double()  # (M, N)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 8])
def test_int8_vnni_matmul_is_blockwise_int8_arithmetic(K, rows):
    if not K.has_vnni():
        pytest.skip("this CPU has no AVX512-VNNI: the int8 decode copies use torch's kernel")
    torch.manual_seed(rows)
    N, Kd = 64, 640
    q = torch.randint(-127, 128, (N, Kd), dtype=torch.int8)
    scales = torch.rand(N) / 100
    x = torch.randn(rows, Kd)
    x[0, :32] = 0  # an all-zero block: scale 0, no division by it
    out = K.int8_vnni_matmul(x, K.pack_int8_vnni(q), scales)
    torch.testing.assert_close(out.double(), _blockwise_reference(x, q, scales), rtol=1e-5, atol=1e-5)
    out16 = K.int8_vnni_matmul(x.bfloat16(), K.pack_int8_vnni(q), scales)
    torch.testing.assert_close(out16.double(), _blockwise_reference(x.bfloat16(), q, scales), rtol=2 ** -8, atol=1e-3)
    # and close to the unquantised product: the activations' blocks cost about 0.5% (relative norm)
    exact = x.double() @ (q.double() * scales.double()[:, None]).T
    assert (out.double() - exact).norm() / exact.norm() < 0.02


def test_int8_vnni_refuses_what_it_cannot_pack(K):
    with pytest.raises(RuntimeError, match="multiple of 16"):
        K.pack_int8_vnni(torch.zeros(10, 64, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="int8"):
        K.pack_int8_vnni(torch.zeros(16, 64))
    if K.has_vnni():
        with pytest.raises(RuntimeError, match="1..8"):
            K.int8_vnni_matmul(torch.zeros(9, 64), K.pack_int8_vnni(torch.zeros(16, 64, dtype=torch.int8)), torch.ones(16))
