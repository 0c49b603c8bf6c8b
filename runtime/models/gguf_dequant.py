"""A GGUF tensor's blocks to float32 in torch operations, for the block types Gemma 3's files use.

`gguf.quants.dequantize` works in numpy over groups of 16 rows: for Gemma 3 270M's Q4_K_M file, 3.8-4.8 s of a
server's start-up on a 2-core Xeon, a third of it splitting the arrays. The same arithmetic on whole tensors in
torch (both threads) takes a fraction of that. Every value equals the package's bit for bit (the oracle,
transformers, loads the file through it): the same float32 products and differences in the same order
(`tests/models/test_gguf_dequant.py`). Other block types go to the package.

Block layouts (ggml's; each block is 32 or 256 consecutive weights of a row):
- Q8_0 (34 bytes): a float16 scale d, 32 int8 values n; weight d * n.
- Q5_0 (22 bytes): d, 32 high bits (a little-endian u32, bit i for value i), 16 bytes of low nibbles (value i < 16
  in byte i's low nibble, value 16 + i in its high one); weight d * (n - 16), n the 5-bit value.
- Q4_K (144 bytes, 256 weights): d and dmin (float16), 12 bytes packing eight 6-bit scales and eight 6-bit mins,
  128 bytes of nibbles (sub-blocks 2c and 2c + 1 are the low and high nibbles of bytes 32c..32c + 31); weight
  (d * scale) * n - (dmin * min) per sub-block of 32.
- Q6_K (210 bytes, 256 weights): 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, d; weight
  (d * scale) * (n - 32) per sixteen.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

QK_K = 256


def _bytes(data: np.ndarray, block_bytes: int) -> torch.Tensor:
    """(blocks, block_bytes) uint8 over the file's memory map (read only: nothing here writes to it)."""
    with warnings.catch_warnings():  # torch warns that the array is not writable
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(data)).view(torch.uint8).reshape(-1, block_bytes)


def _half(raw: torch.Tensor) -> torch.Tensor:
    """(blocks, 2) uint8 little-endian float16 -> (blocks, 1) float32."""
    return raw.contiguous().view(torch.float16).float()


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _half(b[:, :2])


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    high = b[:, 2:6].contiguous().view(torch.int32)  # bit i: value i's fifth bit
    high = (high >> torch.arange(32, dtype=torch.int32)) & 1
    low = torch.cat((b[:, 6:] & 0x0F, b[:, 6:] >> 4), dim=1)
    n = (low.to(torch.int32) | (high << 4)) - 16
    return _half(b[:, :2]) * n.float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    blocks = b.shape[0]
    d, dmin = _half(b[:, :2]), _half(b[:, 2:4])
    s = b[:, 4:16].reshape(blocks, 3, 4)
    lo, mi, hi = s[:, 0], s[:, 1], s[:, 2]
    scale = torch.cat((lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)), dim=1)
    least = torch.cat((mi & 0x3F, (hi >> 4) | ((mi >> 2) & 0x30)), dim=1)
    step = (d * scale.float()).reshape(blocks, 8, 1)
    offset = (dmin * least.float()).reshape(blocks, 8, 1)
    q = b[:, 16:].reshape(blocks, 4, 1, 32)
    n = torch.cat((q & 0x0F, q >> 4), dim=2).reshape(blocks, 8, 32).float()
    return (step * n - offset).reshape(blocks, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    blocks = b.shape[0]
    ql = b[:, :128].reshape(blocks, 2, 1, 64)
    ql = torch.cat((ql & 0x0F, ql >> 4), dim=2).reshape(blocks, 8, 32)
    qh = b[:, 128:192].reshape(blocks, 2, 1, 32)
    qh = torch.cat([(qh >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=2).reshape(blocks, 8, 32)
    n = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(blocks, 16, 16).float()
    scale = b[:, 192:208].contiguous().view(torch.int8).float()
    step = (_half(b[:, 208:210]) * scale).reshape(blocks, 16, 1)
    return (step * n).reshape(blocks, QK_K)


# ggml type name -> (bytes a block, its dequantisation)
_BLOCKS = {"Q8_0": (34, _q8_0), "Q5_0": (22, _q5_0), "Q4_K": (144, _q4_k), "Q6_K": (210, _q6_k)}


def dequantize(data: np.ndarray, tensor_type) -> torch.Tensor:
    """A GGUF tensor's data (as `GGUFFile` or `gguf.GGUFReader` hands it) as float32 in numpy's row-major shape, the
    package's values exactly; always a tensor of its own, never a view of the file's memory map."""
    name = getattr(tensor_type, "name", str(tensor_type))
    if name in _BLOCKS:
        block_bytes, blocks_to_values = _BLOCKS[name]
        rows, row_bytes = data.shape[:-1], data.shape[-1]
        if row_bytes % block_bytes:
            raise ValueError(f"a {name} row of {row_bytes} bytes is not whole blocks of {block_bytes}")
        values = blocks_to_values(_bytes(data, block_bytes))
        return values.reshape(*rows, row_bytes // block_bytes * values.shape[1])
    from gguf.quants import dequantize as package_dequantize

    return torch.from_numpy(np.array(package_dequantize(data, tensor_type), dtype=np.float32))  # F32: a copy
