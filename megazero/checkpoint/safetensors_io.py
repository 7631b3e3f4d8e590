"""File helpers for checkpoints and exports: atomic writes and streaming safetensors I/O.

:func:`atomic_write` writes through a temp file beside the target, fsyncs it, renames it over the target and
fsyncs the directory, so a reader sees the old file or the new one, never a torn one. :func:`write_safetensors`
writes a standard safetensors file one tensor at a time (the header is computed from declared shapes first),
hashing the bytes as they go; :class:`SafetensorsFile` reads any element range of a 1-D tensor with plain
reads (no mmap), so memory stays bounded by what is asked for.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = ["SafetensorsFile", "atomic_write", "fsync_dir", "read_safetensors_header", "sha256_file",
           "write_safetensors"]

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8",
           torch.int64: "I64"}


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename inside it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    """``write(f)`` into a temp file beside ``path``, fsync, rename over ``path``, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


class _HashingWriter:
    def __init__(self, f: Any) -> None:
        self.f, self.sha, self.bytes = f, hashlib.sha256(), 0

    def write(self, data: bytes | memoryview) -> None:
        self.f.write(data)
        self.sha.update(data)
        self.bytes += memoryview(data).nbytes


def write_safetensors(path: str | os.PathLike, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                      produce: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None) -> dict:
    """Write a safetensors file tensor by tensor: ``produce(key)`` is called once per entry, in order, so only
    one tensor is in memory at a time. Atomic (temp file + rename). Returns ``{"sha256", "bytes"}``."""
    entries = list(entries)
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, dtype, shape in entries:
        n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        header[key] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    out: dict[str, Any] = {}

    def write(f: Any) -> None:
        w = _HashingWriter(f)
        w.write(len(head).to_bytes(8, "little") + head)
        for key, dtype, shape in entries:
            t = produce(key).detach().to("cpu", dtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{key}: produced shape {tuple(t.shape)}, declared {tuple(shape)}")
            if t.numel():
                w.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        out.update(sha256=w.sha.hexdigest(), bytes=w.bytes)

    atomic_write(Path(path), write)
    return out


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the byte offset where its data starts."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return header, 8 + n


class SafetensorsFile:
    """Ranged reads of the 1-D tensors of a safetensors file (plain reads: no mmap, memory stays bounded)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.header, self.data_start = read_safetensors_header(path)

    def dtype(self, key: str) -> torch.dtype:
        """The torch dtype of tensor ``key``."""
        return {v: k for k, v in _DTYPES.items()}[self.header[key]["dtype"]]

    def read_into(self, key: str, start: int, out: torch.Tensor) -> None:
        """Fill the contiguous CPU tensor ``out`` with elements ``[start, start + out.numel())`` of ``key``
        (read straight into ``out``'s memory)."""
        meta = self.header[key]
        total, size = int(torch.Size(meta["shape"]).numel()), out.element_size()
        if out.dtype != self.dtype(key) or start < 0 or start + out.numel() > total:
            raise OSError(f"{self.path}: cannot read {key}[{start}:{start + out.numel()}] as {out.dtype} (it has "
                          f"{total} elements of {meta['dtype']})")
        if out.numel() == 0:
            return
        with open(self.path, "rb") as f:
            f.seek(self.data_start + meta["data_offsets"][0] + start * size)
            got = f.readinto(memoryview(out.view(torch.uint8).numpy()).cast("B"))
        if got != out.numel() * size:
            raise OSError(f"{self.path} is truncated (reading {key})")

    def read(self, key: str, start: int = 0, numel: int | None = None) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of the 1-D tensor ``key`` (to its end by default)."""
        total = int(torch.Size(self.header[key]["shape"]).numel())
        out = torch.empty(total - start if numel is None else numel, dtype=self.dtype(key))
        self.read_into(key, start, out)
        return out
