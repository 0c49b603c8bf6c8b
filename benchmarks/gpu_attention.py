"""The Triton paged-attention kernels compiled for a GPU: right, and how near the memory they run.

Gemma 3 270M's attention shapes (4 query heads, 1 KV head, head dim 256), bfloat16 pools with each request's
keys scattered over random slots. For every case the output is checked against a float64 reference on the
host (relative norm error), and timed with CUDA events (Triton's `do_bench`, median). The floor of a decode
call is the bytes it must read (each request's keys and values once, plus q) over the copy bandwidth measured
in the same run; prefill is arithmetic-bound and gets TFLOP/s instead. Needs a CUDA device.

    python benchmarks/gpu_attention.py
"""

from __future__ import annotations

import math
import sys

import torch

H, HKV, D = 4, 1, 256
DTYPE = torch.bfloat16


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read plus written per second."""
    from triton.testing import do_bench

    src = torch.randn(256 * 2**20, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def pools(slots: int, gen: torch.Generator):
    k = torch.randn(slots, HKV, D, generator=gen).to(DTYPE).cuda()
    v = torch.randn(slots, HKV, D, generator=gen).to(DTYPE).cuda()
    return k, v


def scattered(lengths: list[int], slots: int, gen: torch.Generator):
    """Each request's keys on distinct random slots (slot 0, the padding sink, never used)."""
    perm = torch.randperm(slots - 1, generator=gen)[:sum(lengths)] + 1
    indptr = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return indptr, perm.to(torch.int32)


def reference(q, k, v, idx, q_pos, k_pos, scale, window=0):
    """One request in float64 on the host: q (n, H, D), keys at slots idx with positions k_pos."""
    keys = k[idx.long()].double().cpu()
    values = v[idx.long()].double().cpu()
    qd = q.double().cpu()
    group = H // HKV
    scores = torch.einsum("nhd,lhd->nhl", qd, keys.repeat_interleave(group, dim=1)) * scale
    visible = k_pos[None, :] <= q_pos[:, None]
    if window:
        visible &= (q_pos[:, None] - k_pos[None, :]) < window
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("nhl,lhd->nhd", scores.softmax(-1), values.repeat_interleave(group, dim=1))


def rel_err(out, ref) -> float:
    out = out.double().cpu()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm())


def decode_case(batch: int, context: int, bw: float, gen: torch.Generator) -> tuple:
    from triton.testing import do_bench

    from runtime.attention.triton_kernels import decode_attention_fwd

    slots = batch * context + 1
    k, v = pools(slots, gen)
    lengths = [context] * batch
    indptr, indices = scattered(lengths, slots, gen)
    q = torch.randn(batch, H, D, generator=gen).to(DTYPE).cuda()
    o = torch.full((batch, H, D), float("nan"), dtype=DTYPE, device="cuda")  # every row must be written
    scale = D ** -0.5
    args = (q, k, v, o, indptr.cuda(), indices.cuda(), scale)
    decode_attention_fwd(*args)
    torch.cuda.synchronize()
    err = 0.0
    for b in range(batch):
        idx = indices[indptr[b]:indptr[b + 1]]
        pos = torch.arange(context)
        ref = reference(q[b:b + 1], k, v, idx, torch.tensor([context]), pos, scale)
        err = max(err, rel_err(o[b:b + 1], ref))
    ms = do_bench(lambda: decode_attention_fwd(*args), warmup=25, rep=100, return_mode="median")
    bytes_read = batch * context * HKV * D * 2 * k.element_size() + q.numel() * q.element_size()
    floor_ms = bytes_read / (bw / 2) * 1e3  # a copy's rate counts reads and writes; this only reads
    return f"decode b={batch} ctx={context}", err, ms, f"{bytes_read / (ms * 1e-3) / 1e9:.0f} GB/s", ms / floor_ms


def extend_case(batch: int, prompt: int, window: int, gen: torch.Generator) -> tuple:
    from triton.testing import do_bench

    from runtime.attention.triton_kernels import extend_attention_fwd

    slots = batch * prompt + 1
    k, v = pools(slots, gen)
    indptr, indices = scattered([prompt] * batch, slots, gen)
    q = torch.randn(batch * prompt, H, D, generator=gen).to(DTYPE).cuda()
    o = torch.full_like(q, float("nan"))
    pos = torch.arange(prompt).repeat(batch).to(torch.int32)
    scale = D ** -0.5
    args = (q, k, v, o, indptr.cuda(), indptr.cuda(), indices.cuda(), pos.cuda(),
            torch.zeros(batch, dtype=torch.int32, device="cuda"), scale, window)
    extend_attention_fwd(*args, max_extend_len=prompt)
    torch.cuda.synchronize()
    err = 0.0
    for b in range(batch):
        rows = slice(b * prompt, (b + 1) * prompt)
        idx = indices[indptr[b]:indptr[b + 1]]
        ref = reference(q[rows], k, v, idx, torch.arange(prompt), torch.arange(prompt), scale, window)
        err = max(err, rel_err(o[rows], ref))
    ms = do_bench(lambda: extend_attention_fwd(*args, max_extend_len=prompt), warmup=25, rep=100,
                  return_mode="median")
    visible = sum(min(i + 1, window or i + 1) for i in range(prompt)) * batch
    flops = 4 * visible * H * D  # q.k and p.v, a multiply and an add each
    name = f"extend b={batch} len={prompt}" + (f" window={window}" if window else "")
    return name, err, ms, f"{flops / (ms * 1e-3) / 1e12:.1f} TFLOP/s", None


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    gen = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    bw = copy_bandwidth()
    print(f"copy bandwidth (read + write): {bw / 1e9:.0f} GB/s")
    rows = [decode_case(b, c, bw, gen) for b, c in ((1, 600), (1, 4096), (8, 664), (32, 664), (32, 4096))]
    rows += [extend_case(b, n, w, gen) for b, n, w in ((1, 600, 0), (1, 600, 512), (8, 600, 512), (1, 4096, 0))]
    print(f"{'case':34s} {'rel err':>9s} {'ms':>8s} {'rate':>14s} {'x floor':>8s}")
    worst = 0.0
    for name, err, ms, rate, over in rows:
        worst = max(worst, err)
        print(f"{name:34s} {err:9.2e} {ms:8.4f} {rate:>14s} {'' if over is None else f'{over:8.1f}'}")
    ok = worst < 1e-2  # bfloat16 operands: 1e-3 to 1e-2 (float32 accumulation)
    print("all outputs within 1e-2 of the float64 reference" if ok else f"WORST ERROR {worst:.2e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
