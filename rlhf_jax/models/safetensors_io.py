"""Minimal safetensors reading (memory-mapped, lazy) and writing with bfloat16 support.

The ``safetensors`` numpy backend cannot handle bfloat16, the usual dtype of real
checkpoints; the format is simple (an 8-byte header length, a JSON header, raw
little-endian tensor bytes), so we read it with ``np.memmap`` and ``ml_dtypes``.
Reading is lazy: a tensor's bytes are touched only when sliced.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterable

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsError(ValueError):
    """A safetensors file is unreadable or inconsistent."""


def read_header(path: str) -> tuple[dict, int]:
    """(header dict without ``__metadata__``, byte offset where tensor data starts)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise SafetensorsError(f"{path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > os.path.getsize(path):
                raise SafetensorsError(f"{path}: corrupt header length {n}")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: cannot read safetensors header ({e})") from e
    header.pop("__metadata__", None)
    return header, 8 + n


class LazyFile:
    """Tensors of one safetensors file, memory-mapped; ``get(name)`` returns an ndarray view."""

    def __init__(self, path: str):
        self.path = path
        self.header, self._data_start = read_header(path)
        self._mmap = np.memmap(path, dtype=np.uint8, mode="r")

    def keys(self) -> Iterable[str]:
        return self.header.keys()

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in _DTYPES:
            raise SafetensorsError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        shape = tuple(info["shape"])
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise SafetensorsError(f"{self.path}: tensor {name} byte size does not match shape {shape}")
        buf = self._mmap[self._data_start + begin : self._data_start + end]
        return buf.view(dtype).reshape(shape)


def save_file(tensors: dict[str, np.ndarray], path: str, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` to ``path`` (atomically: a temp file renamed into place)."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _NAMES:
            raise SafetensorsError(f"cannot save tensor {name} of dtype {arr.dtype}")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
    os.replace(tmp, path)
