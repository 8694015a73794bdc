"""Read tensors, or a range of one dimension of them, from single or sharded safetensors checkpoints.

The reader parses the safetensors header itself and reads only the bytes of the requested range with
positioned reads (`os.pread`) into a fresh tensor: no memory map, so a rank that loads its shard of a
model never has the rest of the file resident, and the bytes read are exactly the ones it keeps
(a range of a middle dimension is read as one contiguous run per outer index).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class TensorInfo:
    """Where one tensor's bytes lie in its file."""

    def __init__(self, path: Path, name: str, header: dict, data_start: int):
        if header["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {header['dtype']!r}, not one of {sorted(DTYPES)}")
        self.path = path
        self.dtype = DTYPES[header["dtype"]]
        self.shape = tuple(header["shape"])
        begin, end = header["data_offsets"]
        self.offset = data_start + begin
        self.nbytes = end - begin
        expected = math.prod(self.shape) * self.dtype.itemsize
        if self.nbytes != expected:
            raise ValueError(f"{path}: tensor {name!r} holds {self.nbytes} bytes, its shape {self.shape} needs "
                             f"{expected}")


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, by name."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", prefix)
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return {name: TensorInfo(path, name, info, 8 + length) for name, info in header.items()}


class SafetensorsReader:
    """Tensors by name from `hf_dir`'s `model.safetensors` or its shards listed in the index."""

    def __init__(self, hf_dir: str | Path):
        hf_dir = Path(hf_dir)
        if (hf_dir / INDEX_FILE).is_file():
            files = sorted(set(json.loads((hf_dir / INDEX_FILE).read_text())["weight_map"].values()))
        elif (hf_dir / SINGLE_FILE).is_file():
            files = [SINGLE_FILE]
        else:
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {hf_dir}")
        self.tensors: dict[str, TensorInfo] = {}
        for file in files:
            self.tensors.update(read_header(hf_dir / file))
        self._fds: dict[Path, int] = {}

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return self.tensors[name]

    def read(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """`name` restricted to `start:stop` along `dim` (the whole tensor by default), read from disk into
        a new tensor, or straight into `out` when it is a contiguous CPU tensor of that shape and dtype."""
        info = self.info(name)
        if not info.shape:
            return self._read_bytes(info, info.offset, info.nbytes).reshape(())
        stop = info.shape[dim] if stop is None else stop
        if not 0 <= start <= stop <= info.shape[dim]:
            raise IndexError(f"{name}: range {start}:{stop} outside dimension {dim} of size {info.shape[dim]}")
        outer, inner = math.prod(info.shape[:dim]), math.prod(info.shape[dim + 1:])
        item = info.dtype.itemsize
        run = (stop - start) * inner * item  # contiguous bytes per outer index
        shape = (*info.shape[:dim], stop - start, *info.shape[dim + 1:])
        if out is None or not _fits(out, shape, info.dtype):
            out = torch.empty(shape, dtype=info.dtype)
        buffer = out.view(-1).view(torch.uint8).numpy()
        fd = self._fd(info.path)
        for index in range(outer):
            position = info.offset + (index * info.shape[dim] + start) * inner * item
            _pread_into(fd, buffer[index * run:(index + 1) * run], position, info.path)
        return out

    def _read_bytes(self, info: TensorInfo, position: int, nbytes: int) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8)
        _pread_into(self._fd(info.path), out.numpy(), position, info.path)
        return out.view(info.dtype)

    def _fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fits(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    return (out.device.type == "cpu" and out.is_contiguous() and tuple(out.shape) == shape and out.dtype == dtype
            and not out.requires_grad)


def _pread_into(fd: int, buffer, position: int, path: Path) -> None:
    view = memoryview(buffer).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], position + done)
        if got == 0:
            raise ValueError(f"{path}: file ends before byte {position + len(view)} (truncated checkpoint?)")
        done += got
