"""A GGUF file's metadata and tensor directory, read in one pass over its header.

`gguf.GGUFReader` builds a numpy view for every part of every metadata value; Gemma 3's vocabulary is three
arrays of 262,144 entries, and parsing them took 12-28 s per open on a 2-core Xeon, three times per server start
(the model check, the chat template, the weights). Here numeric arrays are one `numpy.frombuffer` each and strings
are sliced from one `bytes` of the header: the same file opens in well under a second.

Tensors come back as `gguf.GGUFReader` hands them (a memory-mapped view: float types as their values in numpy's
row-major shape, quantised ones as bytes per row), so `gguf.quants.dequantize` takes them as they are. Layout facts
(little-endian, versions 2 and 3): magic `GGUF`, u32 version, u64 tensor count, u64 key/value count; each key a
string (u64 length, UTF-8 bytes), a u32 value type, the value; an array a u32 item type, a u64 count, the items;
each tensor a name, u32 dimension count, u64 dimensions (fastest-varying first), u32 ggml type, u64 offset into the
data section, which starts at the next multiple of `general.alignment` (32 unless stated) after the directory.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# value type -> (struct format, numpy dtype) for the fixed-size ones
_SCALARS = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9
_HEADER_CHUNK = 1 << 20  # header bytes read at a time (the directory of a 270M-parameter model: ~6 MB)


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: np.ndarray  # ggml's order: fastest-varying dimension first
    tensor_type: object  # gguf.GGMLQuantizationType
    data: np.ndarray  # memory-mapped, as gguf.GGUFReader shapes it


class GGUFFile:
    """The metadata (`fields`: key -> value; arrays as lists) and tensors of the GGUF file at `path`.

    Raises ValueError for a file that is not GGUF, is truncated, or uses a layout this reader does not know."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._size = self.path.stat().st_size
        with self.path.open("rb") as f:
            magic = f.read(4)
            if magic != MAGIC:
                raise ValueError(f"not a GGUF file (starts with {magic!r}, not {MAGIC!r})")
            self._f, self._buf, self._pos = f, b"", 0
            self._start = 4  # file offset of self._buf[0]
            version = self._unpack("<I")
            if version not in VERSIONS:
                raise ValueError(f"GGUF version {version} (big-endian, or unsupported): versions {VERSIONS} are read")
            tensor_count, field_count = self._unpack("<Q"), self._unpack("<Q")
            self.fields: dict[str, object] = {}
            for _ in range(field_count):
                key = self._string()
                if key in self.fields:
                    raise ValueError(f"key {key!r} appears twice")
                self.fields[key] = self._value(self._unpack("<I"))
            directory = [self._tensor_entry() for _ in range(tensor_count)]
            alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
            if alignment <= 0 or alignment & (alignment - 1):
                raise ValueError(f"general.alignment {alignment} is not a power of two")
            data_start = -(-(self._start + self._pos) // alignment) * alignment
            self._f = None
        self.tensors = self._map(directory, data_start)

    def field(self, name: str, default=None):
        return self.fields.get(name, default)

    # ---- the header, read in chunks ----

    def _take(self, n: int) -> bytes:
        if self._pos + n > len(self._buf):
            rest = self._buf[self._pos:]
            more = self._f.read(max(n - len(rest), _HEADER_CHUNK))
            self._start += self._pos
            self._buf, self._pos = rest + more, 0
            if n > len(self._buf):
                raise ValueError(f"truncated: the header runs past the end of the file ({self._size} bytes)")
        out = self._buf[self._pos:self._pos + n]
        self._pos += n
        return out

    def _unpack(self, fmt: str):
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return self._take(self._unpack("<Q")).decode("utf-8", errors="surrogateescape")

    def _strings(self, count: int) -> list[str]:
        """`count` strings: sliced from the buffer in a tight loop (a vocabulary is 262,144 of them), through
        `_string` only where one crosses the buffer's end."""
        out = []
        for _ in range(count):
            buf, pos = self._buf, self._pos
            if pos + 8 <= len(buf):
                end = pos + 8 + int.from_bytes(buf[pos:pos + 8], "little")
                if end <= len(buf):
                    out.append(buf[pos + 8:end].decode("utf-8", errors="surrogateescape"))
                    self._pos = end
                    continue
            out.append(self._string())
        return out

    def _value(self, kind: int):
        if kind in _SCALARS:
            value = self._unpack(_SCALARS[kind][0])
            return bool(value) if kind == 7 else value
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._unpack("<I"), self._unpack("<Q")
            if item in _SCALARS:
                dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
                return np.frombuffer(self._take(count * dtype.itemsize), dtype=dtype).tolist()
            if item == _STRING:
                return self._strings(count)
            return [self._value(item) for _ in range(count)]  # arrays of arrays
        raise ValueError(f"unknown GGUF value type {kind}")

    def _tensor_entry(self) -> tuple[str, list[int], int, int]:
        name = self._string()
        dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
        return name, dims, self._unpack("<I"), self._unpack("<Q")

    # ---- the tensors, mapped ----

    def _map(self, directory, data_start: int) -> list[GGUFTensor]:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        plain = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}
        mapped = np.memmap(self.path, dtype=np.uint8, mode="r") if directory else None
        tensors, names = [], set()
        for name, dims, raw_type, offset in directory:
            if name in names:
                raise ValueError(f"tensor {name!r} appears twice")
            names.add(name)
            try:
                kind = GGMLQuantizationType(raw_type)
            except ValueError:
                raise ValueError(f"tensor {name!r} has unknown ggml type {raw_type}") from None
            block, block_bytes = GGML_QUANT_SIZES[kind]
            elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
            nbytes = elements * block_bytes // block
            start = data_start + offset
            if start + nbytes > self._size:
                raise ValueError(f"truncated: tensor {name!r} ends at byte {start + nbytes}, the file has "
                                 f"{self._size}")
            shape = tuple(reversed(dims))
            raw = mapped[start:start + nbytes]
            if kind in plain:
                data = raw.view(plain[kind]).reshape(shape)
            else:
                data = raw.reshape(quant_shape_to_byte_shape(shape, kind))
            tensors.append(GGUFTensor(name, np.array(dims, dtype=np.uint64), kind, data))
        return tensors
