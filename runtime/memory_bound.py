"""How close a decode step is to the memory limit: the weight bytes it must read and the machine's read rate.

A batch-1 decode step multiplies one row by every weight of the model once, so on a CPU it is bound by how
fast the weights stream from memory: (bytes read per step) / (read bandwidth) is the floor for its time.
`decode_weight_bytes` counts the bytes of the copy each layer actually multiplies with at `rows` rows (the
int8 LM head below its row limit (its 4-bit screen at decode's rows where screened, the groups refined in 8 bits
not counted), the float head above; int8 weight-only layers; the projections'
int4/int8 decode copies below their row limits; the model's dtype otherwise; one embedding row per token), and
`decode_kv_bytes` the key and value rows its attention reads (each full layer every key of a request, a sliding
layer its window: at 600 tokens on Gemma 3 270M 10 MB, a twentieth of the weights), and
`read_bandwidth` measures the rate at which this process can stream a buffer far larger than the caches, with
the threads torch uses. `swa-runtime bench` prints both and the fraction of that floor a measured step
reaches. A shared machine's bandwidth moves (45 to 80 GB/s from one minute to the next on a 2-core cloud EPYC),
so the bench probes it after each round of steps and holds each round against its own probe.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from runtime import kernels
from runtime.layers.head_screen import screen_max_rows
from runtime.layers.linear import Embedding, Linear
from runtime.layers.quantized import Int8Embedding, _Int8Rows

READ_BUFFER_BYTES = 1 << 30  # far past any last-level cache of the machines this runs on (480 MiB seen)


def _int8_bytes(module: _Int8Rows) -> int:
    return module.weight_int8.numel() + module.scales.numel() * module.scales.element_size()


def _head_bytes(module: nn.Module, rows: int) -> int:
    """Bytes the LM head multiplies with at `rows` rows: its int8 copy where it takes them, else its weight."""
    if isinstance(module, _Int8Rows):
        return _int8_bytes(module)
    copy = getattr(module, "int8", None)
    if copy is not None and rows <= copy.max_rows:
        screen = getattr(copy, "screen", None)
        if screen is not None and rows <= screen_max_rows():  # its 4-bit copy (the groups refined in 8 bits aside)
            return screen.nbytes()
        if copy.kernel_weight is not None:  # our kernel's layout: its own count (per-block scales, if any)
            return copy.kernel_weight.nbytes()
        w = module.weight
        return w.numel() + w.shape[0] * 4  # int8 per-channel weights and their float32 scales
    return module.weight.numel() * module.weight.element_size()


def decode_weight_bytes(model: nn.Module, rows: int = 1) -> int:
    """Weight bytes one forward over `rows` tokens reads: every projection and norm once, the LM head once,
    `rows` rows of the embedding table (a tied head reads the whole table, counted as the head)."""
    total = 0
    head = model.model.embed_tokens if model.lm_head is None else model.lm_head
    for module in model.modules():
        if module is model.lm_head:
            continue  # counted as the head below
        if isinstance(module, (Embedding, Int8Embedding)):
            row = module.embedding_dim * (1 if isinstance(module, Int8Embedding) else module.weight.element_size())
            total += rows * row
        elif isinstance(module, _Int8Rows):
            total += _int8_bytes(module)
        elif isinstance(module, Linear):
            copy = getattr(module, "decode", None)  # DecodeLinear's low-bit copy
            total += copy.nbytes() if copy is not None and rows <= copy.max_rows else (
                module.weight.numel() * module.weight.element_size())
        else:
            total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return total + _head_bytes(head, rows)


def decode_kv_bytes(pool, window: int | None, keys: list[int]) -> int:
    """Key and value bytes one decode step reads from `pool` (a `HybridKVPool`): for each request with `keys[i]`
    keys (its tokens, the new one included), every full-attention layer reads all of them, every sliding layer
    those within `window`; the bytes a token takes in each pool are the pool's own (its layers, heads, dtype)."""
    full, swa = pool.bytes_per_token()  # over all the pool's layers: a key and its value each
    return sum(full * n + swa * (n if window is None else min(n, window)) for n in keys)


def read_bandwidth(repeats: int = 5, nbytes: int = READ_BUFFER_BYTES, buffer: torch.Tensor | None = None) -> float:
    """Bytes per second this process streams from memory (best of `repeats` sums of a buffer of `nbytes`,
    with torch's threads), the denominator of the memory-bound floor. `buffer` (float32, from `read_buffer`):
    one kept for probes repeated between measurements, instead of a new one each time."""
    buf = read_buffer(nbytes) if buffer is None else buffer
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * buf.element_size() / best


def read_buffer(nbytes: int = READ_BUFFER_BYTES) -> torch.Tensor:
    """The probe's buffer, every page touched once (a first touch would be timed as page faults). In 2 MB pages
    where the kernels can ask for them, as the decode weights are placed (`runtime/layers/weight_arena.py`): the
    floor is what the machine reads, not what 4 kB pages let it (a 1 GB sum 1.20x faster on a 2-core Zen 4 EPYC)."""
    module = kernels.load()
    if module is None:
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
    else:
        buf = module.weight_arena(nbytes, True).view(torch.float32)[: nbytes // 4].fill_(1.0)
    buf.sum()
    return buf
