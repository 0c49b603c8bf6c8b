"""Decode's low-bit weights in one buffer of 2 MB pages, in the order a batch-1 step reads them.

A batch-1 step streams every projection's copy and the LM head's once (~200 MB for Gemma 3 270M), each tensor
until now wherever torch's allocator put it, in 4 kB pages: a TLB miss and a page walk every 4 kB, and most of
the layers' copies too small (0.3-2.8 MB) for the kernel to back with larger pages on its own. `place_decode_weights`
moves them into one buffer aligned to 2 MB and asked of the kernel in 2 MB pages (`madvise`, a hint: where
transparent huge pages are off, 4 kB pages serve and nothing else changes), layer by layer in read order, the LM
head's copies last; from 2 MB pages the head streams as one read-ahead stream a thread on Zen 4 (`kLongStream`,
runtime/kernels/quant_kernels.cpp). On a 2-core Zen 4 EPYC, batch-1 steps alternated inside one process between the
same weights placed in 2 MB and in 4 kB pages: 5.62 against 6.45 ms when the memory gave ~60 GB/s, 7.15 against 7.53
at ~35 (docs/performance.md). The probe of the read bandwidth reads from such pages too (`runtime/memory_bound.py`),
so that the floor a step is held against is the machine's, not the page size's: a 1 GB sum ran 1.20x faster from
them.

The copies' values are moved, not changed: every product is the same to the bit (tests/models/test_weight_arena.py).
A decode stack made before holds the old buffers; the copies are counted as set again, so it is remade.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from runtime import kernels
from runtime.layers.decode_linear import DecodeLinear

HUGE_PAGE = 2 << 20
HUGE_PAGE_SHARE = 0.9  # of the buffer in 2 MB pages, from which its copies count as placed in them


@dataclass(frozen=True)
class WeightArena:
    """Where a model's decode weights were placed: the buffer, its size and how much of it is in 2 MB pages."""

    buffer: torch.Tensor
    nbytes: int  # the weights' (and their scales'), each from a 64-byte line
    huge_bytes: int  # of the buffer, backed by 2 MB pages (from /proc/self/smaps)
    projections: int


def decode_projections(model: nn.Module) -> list:
    """Every low-bit copy on our kernels a batch-1 step streams, in the order it reads them: the layers'
    projections (modules in registration order: qkv, o, gate/up, down), then the LM head's 4-bit screen and its
    int8 copy."""
    found = []
    for module in model.modules():
        if isinstance(module, DecodeLinear):
            found.append(getattr(module.decode, "projection", None))
    for module in model.modules():
        copy = getattr(module, "int8", None)
        if copy is not None and hasattr(copy, "kernel_weight"):  # an int8 head (`DynamicInt8Weight`)
            screen = getattr(copy, "screen", None)
            found.append(None if screen is None else screen.coarse)
            found.append(getattr(copy.kernel_weight, "projection", None))
    return [p for p in found if p is not None]


def place_decode_weights(model: nn.Module, huge_pages: bool = True) -> WeightArena | None:
    """Move the decode copies of `model` (`decode_projections`) into one arena in read order (module docstring);
    None where there are none (a float32 model, no low-bit kernels). `huge_pages=False`: 4 kB pages (comparisons)."""
    projections = decode_projections(model)
    if not projections:
        return None
    total = sum(p.placed_bytes for p in projections)
    buffer = kernels.load().weight_arena(total, huge_pages)
    buffer.zero_()  # every page faulted in now, so that what backs them can be read (a few ms for 382 MB)
    huge_bytes = huge_page_bytes(buffer) if huge_pages else 0
    # the kernels' long-stream choice follows the pages actually given (the kernel may lack free 2 MB pages)
    huge = huge_bytes >= HUGE_PAGE_SHARE * buffer.numel()
    offset = 0
    for p in projections:
        offset = p.place(buffer, offset, huge)
    DecodeLinear.copies_set += 1  # what holds the copies (a decode stack) sees the count move and is remade
    return WeightArena(buffer, offset, huge_bytes, len(projections))


def huge_page_bytes(buffer: torch.Tensor, smaps: Path = Path("/proc/self/smaps")) -> int:
    """Bytes of `buffer`'s memory backed by 2 MB pages: the AnonHugePages of the mappings it lies in (0 where
    /proc cannot be read)."""
    start = buffer.data_ptr()
    end = start + buffer.numel() * buffer.element_size()
    try:
        text = smaps.read_text()
    except OSError:
        return 0
    total, inside = 0, False
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low < end and start < high
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return min(total, end - start)
