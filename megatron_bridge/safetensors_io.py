"""Read tensors, or a range of one dimension of them, from single or sharded safetensors checkpoints.

The reader parses the safetensors header itself and reads only the bytes of the requested range with
positioned reads (`os.pread`) straight into the tensor that keeps them (or, for a GPU, a pinned host buffer):
no memory map, so a rank that loads its shard of a model never has the rest of the file resident, and the
bytes read are exactly the ones it keeps (a range of a middle dimension is read as one contiguous run per
outer index).
"""

from __future__ import annotations

import ctypes
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

    def range_shape(self, name: str, dim: int, start: int, stop: int | None) -> tuple[int, ...]:
        """The shape of `start:stop` along `dim` (all of it when `stop` is None), checked to lie inside."""
        if not self.shape:
            return ()
        stop = self.shape[dim] if stop is None else stop
        if not 0 <= start <= stop <= self.shape[dim]:
            raise IndexError(f"{name}: range {start}:{stop} outside dimension {dim} of size {self.shape[dim]}")
        return (*self.shape[:dim], stop - start, *self.shape[dim + 1:])


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
        self._pinned: list[torch.Tensor] = []  # host buffers for reads headed to a GPU, and their copies' events
        self._copied: list = []
        self._turn = 0

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return self.tensors[name]

    def read(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """`name` restricted to `start:stop` along `dim` (the whole tensor by default), in a new CPU tensor."""
        info = self.info(name)
        out = torch.empty(info.range_shape(name, dim, start, stop), dtype=info.dtype)
        self.read_into(name, out, dim, start, stop)
        return out

    def read_into(self, name: str, dest: torch.Tensor, dim: int = 0, start: int = 0, stop: int | None = None) -> None:
        """Put `name[start:stop]` along `dim` into `dest`, a tensor of that shape on any device, of any dtype.

        A contiguous CPU destination of the file's dtype takes the bytes straight from disk. Any other goes
        through a host buffer: for a GPU, one of two pinned buffers, copied without waiting, so that the next
        read overlaps this copy (`wait()`, or leaving the reader, waits for the last copies)."""
        info = self.info(name)
        shape = info.range_shape(name, dim, start, stop)
        if tuple(dest.shape) != shape:
            raise ValueError(f"{info.path}: {name} range {start}:{stop} of dimension {dim} has shape {shape}, "
                             f"its destination {tuple(dest.shape)}")
        if _takes_bytes(dest, info.dtype):
            self._read_range(info, dim, start, stop, dest)
            return
        on_gpu = dest.device.type == "cuda"
        host = self._pinned_buffer(shape, info.dtype) if on_gpu else torch.empty(shape, dtype=info.dtype)
        self._read_range(info, dim, start, stop, host)
        with torch.no_grad():
            dest.copy_(host, non_blocking=on_gpu)
        if on_gpu:
            self._copied[self._turn].record()

    def wait(self) -> None:
        """Wait until every copy into a GPU destination has landed."""
        for event in self._copied:
            event.synchronize()

    def _read_range(self, info: TensorInfo, dim: int, start: int, stop: int | None, out: torch.Tensor) -> None:
        """The range into `out`, a contiguous CPU tensor of its shape and the file's dtype: one contiguous run
        of bytes per index of the dimensions before `dim`."""
        if not info.shape:
            _pread_into(self._fd(info.path), _byte_view(out), info.offset, info.path)
            return
        stop = info.shape[dim] if stop is None else stop
        outer, inner = math.prod(info.shape[:dim]), math.prod(info.shape[dim + 1:])
        item = info.dtype.itemsize
        run = (stop - start) * inner * item
        buffer = _byte_view(out)
        fd = self._fd(info.path)
        for index in range(outer):
            position = info.offset + (index * info.shape[dim] + start) * inner * item
            _pread_into(fd, buffer[index * run:(index + 1) * run], position, info.path)

    def _pinned_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next of the two pinned buffers, once its last copy has landed, grown to hold `shape`."""
        if not self._pinned:
            self._pinned = [torch.empty(0, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self._copied = [torch.cuda.Event() for _ in range(2)]
        self._turn = 1 - self._turn
        self._copied[self._turn].synchronize()
        nbytes = math.prod(shape) * dtype.itemsize
        if self._pinned[self._turn].numel() < nbytes:
            self._pinned[self._turn] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._pinned[self._turn][:nbytes].view(dtype).view(shape)

    def _fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def close(self) -> None:
        self.wait()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _takes_bytes(dest: torch.Tensor, dtype: torch.dtype) -> bool:
    return dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == dtype and not dest.requires_grad


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable buffer. (`tensor.numpy()` would do, but it marks the
    storage not resizable for good, and `actor.offload` frees parameters by resizing their storage.)"""
    return memoryview((ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr()))


def _pread_into(fd: int, buffer, position: int, path: Path) -> None:
    view = memoryview(buffer).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], position + done)
        if got == 0:
            raise ValueError(f"{path}: file ends before byte {position + len(view)} (truncated checkpoint?)")
        done += got
