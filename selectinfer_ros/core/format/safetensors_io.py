"""Minimal safetensors reading and streaming writing with exact byte accounting.

Standard tools (``safetensors.safe_open``) read every file written here. What this module adds:
a writer that streams tensors one at a time (peak memory: one tensor), and a reader that reads
byte ranges of a tensor into caller-provided buffers with ``readinto`` and counts every byte.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


class FormatError(ValueError):
    """A file is not what it claims to be (corrupt, truncated or of another model)."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    nbytes: int


def read_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
    """Parse a safetensors header: (tensors, metadata, header bytes). Refuses corrupt files."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise FormatError(f"{path}: truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER or 8 + n > size:
                raise FormatError(f"{path}: corrupt safetensors header length {n}")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise FormatError(f"{path}: corrupt safetensors header (not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    tensors = {}
    for name, t in header.items():
        try:
            dtype = DTYPES[t["dtype"]]
            begin, end = t["data_offsets"]
            shape = tuple(int(s) for s in t["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"{path}: corrupt entry for tensor {name!r}") from e
        numel = 1
        for s in shape:
            numel *= s
        if end - begin != numel * dtype.itemsize or begin < 0:
            raise FormatError(f"{path}: tensor {name!r} has {end - begin} bytes, shape {shape} needs "
                              f"{numel * dtype.itemsize}")
        if base + end > size:
            raise FormatError(f"{path}: truncated: tensor {name!r} ends at byte {base + end}, "
                              f"file has {size}")
        tensors[name] = TensorInfo(dtype, shape, base + begin, end - begin)
    return tensors, meta, base


class StreamWriter:
    """Writes a safetensors file whose tensor shapes are known up front, one tensor at a time."""

    def __init__(self, path: str | Path, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict = {"__metadata__": dict(metadata or {})}
        offset = 0
        self._order = list(specs)
        for name in self._order:
            dtype, shape = specs[name]
            numel = 1
            for s in shape:
                numel *= s
            nbytes = numel * dtype.itemsize
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._specs = specs
        self._next = 0
        self._f = open(self.path, "wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor; names must come in the order given to the constructor."""
        expected = self._order[self._next]
        dtype, shape = self._specs[name]
        if name != expected or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"expected {expected} {dtype} {shape}, got {name} {tensor.dtype} "
                             f"{tuple(tensor.shape)}")
        self._f.write(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._order):
            raise ValueError(f"{self.path}: {len(self._order) - self._next} tensors not written")
        self._f.close()


class CountingReader:
    """Reads byte ranges of one file into tensors; ``bytes_read`` counts every byte read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._f = open(self.path, "rb", buffering=0)
        if hasattr(os, "posix_fadvise"):
            # Only what is asked for: no read-ahead of neighbouring (unloaded) neurons.
            os.posix_fadvise(self._f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        self.bytes_read = 0

    def read_into(self, offset: int, out: torch.Tensor) -> None:
        """Fill the contiguous CPU tensor ``out`` with the bytes at ``offset``."""
        view = memoryview(out.view(torch.uint8).numpy()).cast("B")
        got = os.preadv(self._f.fileno(), [view], offset) if hasattr(os, "preadv") else None
        if got is None:
            self._f.seek(offset)
            got = self._f.readinto(view)
        if got != len(view):
            raise FormatError(f"{self.path}: truncated read at byte {offset} "
                              f"({got} of {len(view)} bytes)")
        self.bytes_read += got

    def read_tensor(self, info: TensorInfo) -> torch.Tensor:
        out = torch.empty(info.shape, dtype=info.dtype)
        self.read_into(info.start, out)
        return out

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "CountingReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
