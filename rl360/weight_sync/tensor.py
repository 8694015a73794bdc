"""`tensor`: engines on the sender's host, two formats of `/update_weights_from_tensor` with one
`serialized_named_tensors` entry each, chosen per bucket. No pickle anywhere.

- Buckets holding CUDA tensors: `load_format` "rl360_cuda_ipc" (`cuda_ipc`): the bucket is packed into one CUDA
  buffer, and each engine gets the base64 of a JSON descriptor of that buffer's CUDA IPC handle, the GPU's UUID
  and per tensor `name`, `dtype`, `shape`, byte `offset`; the engine (on the same GPU, else it refuses) copies the
  tensors device-to-device and closes the mapping before answering. Two buffers alternate, so the next bucket is
  packed while the engines copy; both are freed when the update ends. `cuda_ipc=False` sends CUDA tensors the
  host way below instead (engines on other GPUs of this host).
- Other buckets: `load_format` "rl360_shared_memory" (`formats`): the bucket is written to one file in /dev/shm
  (or `scratch_dir`); the engine maps the file and copies the tensors; the file is removed once every engine
  answered.

Real SGLang engines take neither: on GPU they want their "flattened_bucket" format (pickled CUDA IPC handles),
which rl360 does not send; use `distributed` with them.
"""

from __future__ import annotations

import concurrent.futures
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rl360.core.client import EngineTimeout
from rl360.weight_sync.calls import EngineCalls
from rl360.weight_sync.cuda_ipc import CUDA_IPC_LOAD_FORMAT, CudaIpcPacker, PackedBucket
from rl360.weight_sync.formats import SHARED_MEMORY_LOAD_FORMAT, write_shared_bucket
from rl360.weight_sync.registry import SyncOptions, register_strategy


@dataclass
class _InFlight:
    """A CUDA IPC bucket's requests: the replies and each engine's reference counter, by URL."""

    replies: dict[str, concurrent.futures.Future]
    counters: dict[str, tuple[bytes, int]]


@register_strategy("tensor", summary="engine=server on the same host: CUDA IPC for GPU weights on the engine's "
                   "GPU, else shared memory", engines=("server",), same_host=True, stand_in=True,
                   engines_note="sends rl360's own formats (rl360_shared_memory, rl360_cuda_ipc), which "
                                "rollout.engine=server reads and SGLang does not (SGLang's pickled 'flattened_bucket' "
                                "format is not sent)")
class TensorSync:
    def __init__(self, calls: EngineCalls, scratch_dir: str | None, cuda_ipc: bool):
        self.calls, self.scratch_dir, self.cuda_ipc = calls, scratch_dir, cuda_ipc

    @classmethod
    def from_options(cls, calls: EngineCalls, options: SyncOptions) -> TensorSync:
        return cls(calls, options.scratch_dir, options.cuda_ipc)

    def reset(self) -> None:
        """Nothing is held with the engines between updates."""

    def send(self, stream: Iterator[tuple[list, bool]], version: int) -> None:
        """`tensor`: buckets holding CUDA tensors by CUDA IPC (unless `cuda_ipc` is off), one request in flight
        while the next bucket is packed; other buckets through shared-memory files."""
        packer: CudaIpcPacker | None = None
        packed: PackedBucket | None = None
        in_flight: _InFlight | None = None
        try:
            for bucket, last in stream:
                if self.cuda_ipc and any(tensor.is_cuda for _, tensor in bucket):
                    packer = packer or CudaIpcPacker()
                    packed = packer.pack(bucket)  # overlaps the engines' copy of the previous bucket
                    previous, in_flight = in_flight, None
                    self._settle(previous, packer)
                    in_flight = self._post_ipc_bucket(packer, packed, version, last)
                else:
                    previous, in_flight = in_flight, None
                    self._settle(previous, packer)
                    self._share_bucket(bucket, version, last)
            previous, in_flight = in_flight, None
            self._settle(previous, packer)
        finally:
            if in_flight is not None:  # failed while a request was out: its buffer stays until the engines answer
                concurrent.futures.wait(in_flight.replies.values())
                self._release_unopened(in_flight, packer)
            packed = None
            if packer is not None:
                packer.close()

    def _post_ipc_bucket(self, packer: CudaIpcPacker, packed: PackedBucket, version: int, last: bool) -> _InFlight:
        shared = {url: packer.share(packed) for url in self.calls.urls}  # one handle (and reference count) per engine
        replies = self.calls.to_all(lambda client: client.update_weights_from_serialized(
            shared[client.url][0], CUDA_IPC_LOAD_FORMAT, version, last_bucket=last))
        return _InFlight(replies, {url: counter for url, (_, counter) in shared.items()})

    def _settle(self, in_flight: _InFlight | None, packer: CudaIpcPacker | None) -> None:
        """Wait for every engine's answer to a CUDA IPC bucket; raise an `EngineError` naming those that failed."""
        if in_flight is None:
            return
        concurrent.futures.wait(in_flight.replies.values())
        self._release_unopened(in_flight, packer)
        self.calls.raise_failures(in_flight.replies)

    @staticmethod
    def _release_unopened(in_flight: _InFlight, packer: CudaIpcPacker) -> None:
        """Release the reference counts of the engines that failed with an answer (their mapping is closed, or
        was never opened) or were never reached, so the buffer is freed; an engine that timed out may still hold
        the mapping, and torch keeps the buffer for it."""
        for url, reply in in_flight.replies.items():
            error = reply.exception()
            if error is not None and not isinstance(error, EngineTimeout):
                packer.release(in_flight.counters[url])

    def _share_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: int, last: bool) -> None:
        directory = self.scratch_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        path, entry, _ = write_shared_bucket(bucket, directory)  # CUDA tensors are copied to the host here
        try:
            self.calls.raise_failures(self.calls.to_all(lambda client: client.update_weights_from_serialized(
                entry, SHARED_MEMORY_LOAD_FORMAT, version, last_bucket=last)))
        finally:
            os.unlink(path)

