"""The tensors of a GGUF file without its metadata: names, types, shapes and memory-mapped data.

gguf's GGUFReader parses every metadata field into Python objects, seconds for a Qwen2.5 file
(151,936 tokens and as many merges); loading weights needs none of it, so this reader skips
the metadata values (walking over string arrays by their lengths) and reads only the tensor
table.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from braid.files import ModelLoadError

# GGUF value types: fixed sizes, 8 = string, 9 = array.
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_FLOAT_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                 GGMLQuantizationType.F64: np.float64}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # ggml order (fastest dimension first), as GGUFReader gives it
    data: np.ndarray  # float types: [rows, cols] values; quantized: [rows, bytes per row]


class _Cursor:
    def __init__(self, buf: np.memmap) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buf, self.pos)  # type: ignore[arg-type]
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8")

    def skip_value(self, vtype: int) -> None:
        if vtype == _STRING:
            (n,) = self.unpack("<Q")
            self.pos += n
        elif vtype == _ARRAY:
            etype, count = self.unpack("<IQ")
            if etype in _SIZES:
                self.pos += _SIZES[etype] * count
            else:
                for _ in range(count):
                    self.skip_value(etype)
        else:
            self.pos += _SIZES[vtype]


def read_tensors(path: Path) -> list[GGUFTensor]:
    """Every tensor of the GGUF, its data a view into a memory map of the file."""
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(buf)
    try:
        magic, version, n_tensors, n_kv = cur.unpack("<4sIQQ")
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"not a GGUF v2+ file (magic {magic!r}, version {version})")
        alignment = 32
        for _ in range(n_kv):
            key = cur.string()
            (vtype,) = cur.unpack("<I")
            if key == "general.alignment" and vtype == 4:
                (alignment,) = cur.unpack("<I")
            else:
                cur.skip_value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            (n_dims,) = cur.unpack("<I")
            dims = cur.unpack(f"<{n_dims}Q")
            qtype, offset = cur.unpack("<IQ")
            infos.append((name, dims, GGMLQuantizationType(qtype), offset))
        start = -(-cur.pos // alignment) * alignment
        return [_tensor(buf, start, *info) for info in infos]
    except (struct.error, ValueError, KeyError, IndexError) as e:
        raise ModelLoadError(f"cannot read GGUF file {path} (truncated or corrupt?): {e}") from e


def _tensor(buf: np.memmap, start: int, name: str, dims: tuple[int, ...],
            qtype: GGMLQuantizationType, offset: int) -> GGUFTensor:
    cols = dims[0]
    rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    row_bytes = cols // block * block_bytes
    raw = buf[start + offset : start + offset + rows * row_bytes]
    if raw.size != rows * row_bytes:
        raise ValueError(f"tensor {name} runs past the end of the file")
    data: np.ndarray = raw.reshape(rows, row_bytes)
    if qtype in _FLOAT_DTYPES:
        data = data.view(_FLOAT_DTYPES[qtype])
    if len(dims) == 1:
        data = data.reshape(-1)
    return GGUFTensor(name, qtype, np.array(dims), data)
