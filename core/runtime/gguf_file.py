"""The tensor table of a GGUF file, and one tensor's bytes read on demand.

The `gguf` package's reader builds Python objects for every metadata value, a tokenizer's vocabulary and merges
included (hundreds of thousands of small arrays for a 49K vocabulary), over a mapping of the whole file whose pages
count as the process's memory once read. A model load needs neither: it needs each tensor's type, shape and place in
the file, and then that tensor's bytes once. So the header is walked here, skipping the metadata values (only
`general.alignment` is read), and a tensor's bytes are read with one positioned read into memory it owns.

Layout (GGUF v2 and v3, little-endian): magic, version, tensor count, metadata count; each metadata entry as key,
value type, value; each tensor as name, dims (the row length first), GGML type, offset; the tensor data, aligned,
after the table.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
# bytes of each fixed-size metadata value type (GGUFValueType): uint8, int8, uint16, int16, uint32, int32, float32,
# bool, then uint64, int64, float64
VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
UINT32 = 4
# GGML types by number: name, elements per block, bytes per block. Those a load reads (core/runtime/gguf_weights.py
# runs F32, F16, Q8_0 and Q4_1 natively) are listed; any other comes from the gguf package (ggml's full list), which
# is imported only then: a model whose every tensor is listed here loads without it.
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34), 30: ("BF16", 1, 2)}
# the element type of an unquantized GGML type's data; quantized data is read as bytes
ELEMENT_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    kind: str  # the GGML type's name: F32, F16, Q8_0, Q4_1, ...
    shape: tuple[int, ...]  # GGML order: the row length first
    offset: int  # of its first byte in the file
    n_bytes: int


class _Cursor:
    """Reads little-endian fields from a buffer, front to back."""

    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (n,) = self.unpack("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8")

    def skip_string(self) -> None:
        (n,) = self.unpack("Q")
        self.pos += n

    def skip_value(self, vtype: int) -> None:
        if vtype == STRING:
            self.skip_string()
        elif vtype == ARRAY:
            etype, count = self.unpack("IQ")
            if etype in VALUE_SIZES:
                self.pos += VALUE_SIZES[etype] * count
            else:  # strings, or arrays of arrays: each element's length is in the element
                for _ in range(count):
                    self.skip_value(etype)
        elif vtype in VALUE_SIZES:
            self.pos += VALUE_SIZES[vtype]
        else:
            raise ValueError(f"unknown GGUF metadata value type {vtype}")


def read_table(path: Path) -> dict[str, TensorEntry]:
    """The tensors of a GGUF file by name. Only the header's pages are read (through a mapping closed at once)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _parse(_Cursor(buf), path)
        except struct.error:
            raise ValueError(f"{path.name}: truncated GGUF header") from None


def ggml_type(number: int) -> tuple[str, int, int]:
    """A GGML type's name, elements per block and bytes per block."""
    if number in GGML_TYPES:
        return GGML_TYPES[number]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        kind = GGMLQuantizationType(number)
    except ValueError:
        raise ValueError(f"unknown GGML tensor type {number}") from None
    return (kind.name, *GGML_QUANT_SIZES[kind])


def _parse(cur: _Cursor, path: Path) -> dict[str, TensorEntry]:
    if bytes(cur.buf[:4]) != MAGIC:
        raise ValueError(f"{path.name}: not a GGUF file")
    cur.pos = 4
    version, n_tensors, n_meta = cur.unpack("IQQ")
    if version not in VERSIONS:
        raise ValueError(f"{path.name}: GGUF version {version} (a big-endian file?); supported: 2, 3, little-endian")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(n_meta):
        key = cur.string()
        (vtype,) = cur.unpack("I")
        if key == "general.alignment" and vtype == UINT32:
            (alignment,) = cur.unpack("I")
        else:
            cur.skip_value(vtype)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        (n_dims,) = cur.unpack("I")
        dims = cur.unpack(f"{n_dims}Q")
        kind, offset = cur.unpack("IQ")
        infos.append((name, kind, dims, offset))
    start = -(-cur.pos // alignment) * alignment
    table = {}
    for name, kind, dims, offset in infos:
        type_name, block, size = ggml_type(kind)
        n_bytes = int(np.prod(dims, dtype=np.int64)) * size // block
        table[name] = TensorEntry(name, type_name, tuple(int(d) for d in dims), start + offset, n_bytes)
    return table


def read_tensor(path: Path, entry: TensorEntry) -> np.ndarray:
    """A tensor's data as the `gguf` reader shapes it (numpy order, the row length last): elements for F32, F16 and
    the integer types, raw bytes per row for quantized types. Read straight into an array of its own."""
    data = np.empty(entry.n_bytes, dtype=np.uint8)
    view, done = memoryview(data), 0
    with open(path, "rb", buffering=0) as f:
        f.seek(entry.offset)
        while done < entry.n_bytes:
            n = f.readinto(view[done:])
            if not n:
                raise ValueError(f"{path.name}: tensor {entry.name} runs past the end of the file")
            done += n
    rows = tuple(reversed(entry.shape))
    dtype = ELEMENT_TYPES.get(entry.kind)
    if dtype is not None:
        return data.view(dtype).reshape(rows)
    return data.reshape(*rows[:-1], -1)
