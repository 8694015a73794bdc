"""The weight formats an engine reads, one `serialized_named_tensors` entry each (the CUDA IPC one is in
`cuda_ipc`, the safetensors one on the bottom floor, `rl360.core.wire`, since the engine client sends it):

- "rl360_shared_memory": a bucket written to one file in /dev/shm as one flat byte buffer (`flat_bucket`),
  described by the base64 of a JSON descriptor (`path`, `bytes`, per tensor `name`, `dtype`, `shape`, byte
  `offset`); the engine maps the file and copies the tensors out.
- "rl360_safetensors": the base64 of a safetensors file (`encode_tensor_bucket` / `decode_tensor_bucket`).
"""

from __future__ import annotations

import base64
import contextlib
import json
import mmap
import os
import stat
import tempfile
from typing import Any

import torch

from rl360.core.wire import TENSOR_LOAD_FORMAT, check_unique, decode_tensor_bucket, encode_tensor_bucket
from rl360.weight_sync.flat_bucket import WEIGHT_DTYPES, check_specs, dtype_name, is_count, read_descriptor, unpack

__all__ = ["ALIGNMENT", "SHARED_MEMORY_LOAD_FORMAT", "TENSOR_LOAD_FORMAT", "WEIGHT_DTYPES", "decode_tensor_bucket",
           "dtype_name", "encode_tensor_bucket", "read_shared_bucket", "write_shared_bucket"]

SHARED_MEMORY_LOAD_FORMAT = "rl360_shared_memory"  # base64 of a JSON descriptor of a file in shared memory
SHARED_FILE_PREFIX, SHARED_FILE_SUFFIX = "rl360-weights-", ".bin"
ALIGNMENT = 64  # byte offset of every tensor in a shared-memory bucket


def write_shared_bucket(named_tensors: list[tuple[str, torch.Tensor]], directory: str) -> tuple[str, str, int]:
    """Write a bucket into one new file under `directory` (readable by this user only); return its path, the
    SHARED_MEMORY_LOAD_FORMAT entry describing it and the tensor bytes written."""
    check_unique([name for name, _ in named_tensors])
    fd, path = tempfile.mkstemp(prefix=SHARED_FILE_PREFIX, suffix=SHARED_FILE_SUFFIX, dir=directory)
    tensors, offset = [], 0
    try:
        with os.fdopen(fd, "wb") as out:
            for name, tensor in named_tensors:
                data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
                offset += -offset % ALIGNMENT
                out.seek(offset)
                out.write(memoryview(data))
                tensors.append({"name": name, "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape),
                                "offset": offset})
                offset += data.nbytes
            out.truncate(offset)  # the file holds every offset named, trailing empty tensors' included
    except BaseException:
        os.unlink(path)
        raise
    descriptor = {"path": path, "bytes": offset, "tensors": tensors}
    return path, base64.b64encode(json.dumps(descriptor).encode()).decode("ascii"), offset


def read_shared_bucket(entry: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors a SHARED_MEMORY_LOAD_FORMAT entry describes, copied out of the mapped file; ValueError
    naming what is wrong. The file must be a regular file (not a link) named rl360-weights-*.bin and owned by
    this process's user, so the route cannot be pointed at other files of the server's host."""
    descriptor = _shared_descriptor(entry)
    path = descriptor["path"]
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as err:
        raise ValueError(f"cannot open {path!r} on the engine's host ({err.strerror}): the 'tensor' weight sync "
                         "needs the engine on the sender's host") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise ValueError(f"{path!r} is not a regular file owned by the engine's user")
        if info.st_size < descriptor["bytes"]:
            raise ValueError(f"{path!r} holds {info.st_size} bytes, the descriptor says {descriptor['bytes']}")
        if descriptor["bytes"] == 0:  # only empty tensors (nothing to map)
            return [(spec["name"], torch.empty(spec["shape"], dtype=WEIGHT_DTYPES[spec["dtype"]]))
                    for spec in descriptor["tensors"]]
        mapped = mmap.mmap(fd, descriptor["bytes"], access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    flat = torch.frombuffer(mapped, dtype=torch.uint8)
    bucket = unpack(flat, descriptor["tensors"])
    del flat
    with contextlib.suppress(BufferError):
        mapped.close()
    return bucket


def _shared_descriptor(entry: Any) -> dict:
    descriptor = read_descriptor(entry, ("path", "bytes", "tensors"))
    path, size, tensors = descriptor["path"], descriptor["bytes"], descriptor["tensors"]
    name = os.path.basename(path) if isinstance(path, str) else ""
    if not (name and os.path.isabs(path) and name.startswith(SHARED_FILE_PREFIX) and name.endswith(SHARED_FILE_SUFFIX)):
        raise ValueError(f"'path' must be an absolute path to a {SHARED_FILE_PREFIX}*{SHARED_FILE_SUFFIX} file, "
                         f"got {path!r}")
    if not is_count(size):
        raise ValueError(f"'bytes' must be a non-negative integer, got {size!r}")
    check_specs(tensors, size)
    return descriptor


