"""Weight sync between a trainer-side process and rollout engines on SGLang's protocol: the sender, the wire
formats both sides share, and the process-group helper both sides use.

    sender = WeightSender(["http://10.0.0.2:30000", ...], strategy="distributed", master_address="10.0.0.1")
    metrics = sender.send(buckets, version=7)  # buckets: an iterable of [(hf_name, tensor), ...]
    sender.set_engines(urls)                    # membership changed (an engine restarted)
    sender.close()

The sender runs in a process that holds full Hugging Face-named tensors (the policy's export rank; any
plain process works). `send` puts every bucket into every engine; the last bucket carries `flush_cache:
true`, where the engine checks that every parameter arrived and only then serves the new version (an
`rl360 serve rollout` engine stages the buckets and swaps them in at once, so a refused update leaves the old
weights and version in place). An engine that refuses raises `EngineError` naming its URL and the engine's
message (e.g. the missing weights). Every request carries `weight_version` (the decimal version): engines
refuse older versions. `send` returns `weight_sync/bytes` (the update's tensor bytes, one copy),
`weight_sync/seconds`, `weight_sync/buckets` and `weight_sync/tensors`. One sender is used by one thread.

Strategies:

- `distributed`: a torch.distributed group between this process (rank 0) and every engine (engine i's ranks
  start at `1 + sum(engine_ranks[:i])`; an SGLang engine with tensor parallelism 2 has 2 ranks), created on
  the first send after construction or `set_engines`: the sender hosts a TCP store on a free port of
  `master_address`, POSTs `/init_weights_update_group` (SGLang's fields) to every engine while joining the
  group itself, under a group name new for each creation. Per bucket it POSTs
  `/update_weights_from_distributed` (`names`, `dtypes` as SGLang spells them: "float32", "bfloat16", ...,
  `shapes`, `group_name`, `flush_cache`, `weight_version`) to every engine, broadcasts each tensor from rank
  0 in the order of `names`, then waits for every reply. `backend` "gloo" sends CPU tensors (CUDA tensors are
  copied to the CPU first), "nccl" CUDA tensors (CPU tensors are copied to the current GPU first). An engine
  that fails before receiving every tensor (unreachable, or refusing at once: every engine answered and the
  broadcasts still wait after TRANSFER_GRACE_S) leaves the group unusable: the sender then drops it (the next
  send creates a new one). Engines that refuse after receiving (an old version, missing weights) leave it
  usable. `set_engines` and `close` POST `/destroy_weights_update_group` to the engines still reachable and
  destroy this side. The group is made exactly as SGLang's engine makes its side (`open_process_group`), so
  the same sender serves real SGLang engines.
- `tensor`: engines on this host, two formats of `/update_weights_from_tensor` with one
  `serialized_named_tensors` entry each, chosen per bucket. No pickle anywhere.
  - Buckets holding CUDA tensors: `load_format` "rl360_cuda_ipc" (`rl360.rollout.cuda_ipc`): the bucket is
    packed into one CUDA buffer, and each engine gets the base64 of a JSON descriptor of that buffer's CUDA IPC
    handle, the GPU's UUID and per tensor `name`, `dtype`, `shape`, byte `offset`; the engine (on the same GPU,
    else it refuses) copies the tensors device-to-device and closes the mapping before answering. Two buffers
    alternate, so the next bucket is packed while the engines copy; both are freed when the update ends.
    `cuda_ipc=False` sends CUDA tensors the host way below instead (engines on other GPUs of this host).
  - Other buckets: `load_format` "rl360_shared_memory": the bucket is written to one file in /dev/shm (or
    `scratch_dir`) as one flat byte buffer, described by the base64 of a JSON descriptor (`path`, `bytes`, and per
    tensor `name`, `dtype`, `shape`, byte `offset`); the engine maps the file and copies the tensors; the sender
    removes the file once every engine answered.
  Real SGLang engines take neither: on GPU they want their "flattened_bucket" format (pickled CUDA IPC
  handles), which rl360 does not send; use `distributed` with them.
- `disk`: the buckets are written as safetensors shards into a new directory under `scratch_dir` (default:
  the system's temporary directory; it must be visible to every engine), then every engine gets
  `/update_weights_from_disk` with that `model_path`; the directory is removed once every engine answered.
  `rl360 serve rollout` loads just the safetensors files into its model (no config.json needed); real SGLang
  loads a directory through its model loader, which also wants the checkpoint's config.json.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import contextlib
import datetime
import json
import mmap
import os
import shutil
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist

from rl360.config import ConfigError
from rl360.rollout.client import EngineClient, EngineError, EngineTimeout
from rl360.rollout.cuda_ipc import CUDA_IPC_LOAD_FORMAT, CudaIpcPacker, PackedBucket
from rl360.rollout.flat_bucket import WEIGHT_DTYPES, check_specs, dtype_name, read_descriptor, unpack
from rl360.rollout.flat_bucket import check_unique as _check_unique
from rl360.rollout.flat_bucket import is_count as _is_count

STRATEGIES = ("distributed", "tensor", "disk")
BACKENDS = ("gloo", "nccl")
TENSOR_LOAD_FORMAT = "rl360_safetensors"  # base64 of a safetensors file (EngineClient.update_weights_from_tensor)
SHARED_MEMORY_LOAD_FORMAT = "rl360_shared_memory"  # base64 of a JSON descriptor of a file in shared memory
SHARED_FILE_PREFIX, SHARED_FILE_SUFFIX = "rl360-weights-", ".bin"
ALIGNMENT = 64  # byte offset of every tensor in a shared-memory bucket
TRANSFER_GRACE_S = 2.0  # after every engine answered, broadcasts still pending this long mean the group broke
DESTROY_TIMEOUT_S = 10.0


# ---- the process group (both sides) ----
def open_process_group(backend: str, address: str, port: int, world_size: int, rank: int, group_name: str,
                       timeout: float | datetime.timedelta, store: dist.Store | None = None) -> dist.ProcessGroup:
    """Join the weight-update group `group_name` as `rank` of `world_size`, the way SGLang's engine joins it
    (`init_custom_process_group`): a TCP rendezvous at `address:port` (rank 0 hosts the store), the store
    prefixed with the group name, a group built by `_new_process_group_helper` whose ranks are its own (not
    the default group's), so `broadcast(src=0, group=...)` means rank 0 of this group. Works with or without
    a default process group in this process. `store`: an already opened store (rank 0 passes the one it
    hosts, see `host_store`); otherwise one is opened from `address:port`."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of world_size {world_size}")
    if not group_name:
        raise ValueError("group_name must not be empty")
    timeout = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
    if store is None:
        host = f"[{address}]" if ":" in address else address
        store, rank, world_size = next(dist.rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def host_store(address: str, world_size: int, timeout: float) -> dist.TCPStore:
    """The rendezvous store rank 0 hosts on a free port of `address` (its `.port`)."""
    return dist.TCPStore(address, 0, world_size, True, datetime.timedelta(seconds=timeout), wait_for_workers=False)


def close_process_group(group: dist.ProcessGroup) -> None:
    """Destroy a group made by `open_process_group` (this side only)."""
    with contextlib.suppress(ValueError):  # already destroyed
        dist.destroy_process_group(group)


# ---- wire formats ----
def encode_tensor_bucket(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """A bucket of `(hf_name, tensor)` as a `serialized_named_tensors` entry in TENSOR_LOAD_FORMAT."""
    from safetensors.torch import save

    _check_unique([name for name, _ in named_tensors])
    return base64.b64encode(save(_owning_copies(named_tensors))).decode("ascii")


def decode_tensor_bucket(entry: Any) -> list[tuple[str, torch.Tensor]]:
    """The pairs of one TENSOR_LOAD_FORMAT entry; ValueError saying what is malformed."""
    from safetensors.torch import load

    if not isinstance(entry, str):
        raise ValueError("entries must be base64 strings")
    try:
        return list(load(base64.b64decode(entry, validate=True)).items())
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"not base64 of a safetensors file: {err}") from None
    except Exception as err:  # safetensors raises its own error type for a malformed header
        raise ValueError(f"not a safetensors file: {err}") from None


def write_shared_bucket(named_tensors: list[tuple[str, torch.Tensor]], directory: str) -> tuple[str, str, int]:
    """Write a bucket into one new file under `directory` (readable by this user only); return its path, the
    SHARED_MEMORY_LOAD_FORMAT entry describing it and the tensor bytes written."""
    _check_unique([name for name, _ in named_tensors])
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
    if not _is_count(size):
        raise ValueError(f"'bytes' must be a non-negative integer, got {size!r}")
    check_specs(tensors, size)
    return descriptor


def _owning_copies(named_tensors: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """CPU tensors that each own their whole storage, as safetensors requires: a view into a larger tensor (a
    slice of a fused weight) or a tensor sent under two names (tied weights) is copied."""
    seen: set[int] = set()
    owned = {}
    for name, tensor in named_tensors:
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage()
        if storage.nbytes() != tensor.numel() * tensor.element_size() or storage.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        owned[name] = tensor
    return owned


# ---- the sender ----
class EngineUnreachable(EngineError):
    """No reply: the engine could not be reached (the request never arrived, so nothing was received)."""


@dataclass
class _InFlight:
    """A CUDA IPC bucket's requests: the replies and each engine's reference counter, by URL."""

    replies: dict[str, concurrent.futures.Future]
    counters: dict[str, tuple[bytes, int]]


@dataclass
class _Group:
    name: str
    group: dist.ProcessGroup
    urls: list[str]


class _EventLoopThread:
    """An asyncio loop on a daemon thread, so HTTP requests run while this thread broadcasts."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rl360-weight-sender", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class WeightSender:
    """Sends full weight updates to rollout engines (see the module docstring for the strategies)."""

    def __init__(self, urls: list[str], strategy: str, api_key: str | None = None, backend: str = "gloo",
                 master_address: str = "127.0.0.1", timeout_s: float = 600.0, engine_ranks: list[int] | None = None,
                 scratch_dir: str | None = None, cuda_ipc: bool = True):
        if strategy not in STRATEGIES:
            raise ConfigError(f"weight sync strategy must be one of {STRATEGIES}, got {strategy!r}")
        if backend not in BACKENDS:
            raise ConfigError(f"weight sync backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "nccl" and strategy == "distributed" and not torch.cuda.is_available():
            raise ConfigError("weight sync backend 'nccl' needs CUDA, which this process does not have: use 'gloo'")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ConfigError(f"timeout_s must be a positive number, got {timeout_s!r}")
        if scratch_dir is not None and not Path(scratch_dir).is_dir():
            raise ConfigError(f"scratch_dir {scratch_dir!r} is not a directory")
        self.strategy, self.backend, self.master_address = strategy, backend, master_address
        self.api_key, self.timeout_s, self.scratch_dir = api_key, float(timeout_s), scratch_dir
        self.cuda_ipc = bool(cuda_ipc)
        self._loop = _EventLoopThread()
        self._clients: dict[str, EngineClient] = {}
        self._ranks: dict[str, int] = {}
        self._group: _Group | None = None
        self._closed = False
        try:
            self.set_engines(urls, engine_ranks)
        except BaseException:
            self._loop.stop()
            raise

    @property
    def urls(self) -> list[str]:
        return list(self._clients)

    @property
    def group_name(self) -> str | None:
        """The open weight-update group's name ("distributed"; None before the first send)."""
        return self._group.name if self._group else None

    def set_engines(self, urls: list[str], engine_ranks: list[int] | None = None) -> None:
        """Send to `urls` from now on (`engine_ranks`: ranks per engine; default: what a known URL had, else
        1). An open group is destroyed (on the engines still reachable too); the next send creates a new one."""
        self._check_open()
        if not isinstance(urls, list) or not urls or not all(isinstance(u, str) and u for u in urls):
            raise ConfigError(f"urls must be a non-empty list of engine URLs, got {urls!r}")
        urls = [url.rstrip("/") for url in urls]
        if len(set(urls)) != len(urls):
            raise ConfigError(f"urls name an engine twice: {urls}")
        if engine_ranks is None:
            engine_ranks = [self._ranks.get(url, 1) for url in urls]
        if len(engine_ranks) != len(urls) or not all(_is_count(r) and r > 0 for r in engine_ranks):
            raise ConfigError(f"engine_ranks must hold one positive integer per engine, got {engine_ranks!r}")
        self._close_group()
        self._close_clients()
        self._ranks = dict(zip(urls, engine_ranks))
        self._clients = {url: self._loop.submit(self._client(url)).result() for url in urls}

    async def _client(self, url: str) -> EngineClient:
        return EngineClient(url, api_key=self.api_key, timeout_s=self.timeout_s)

    def close(self) -> None:
        """Destroy the group (both sides) and stop; a closed sender sends nothing more."""
        if self._closed:
            return
        try:
            self._close_group()
            self._close_clients()
        finally:
            self._closed = True
            self._loop.stop()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- send ----
    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> dict[str, float]:
        """Every bucket into every engine; the last one marks the update complete (`flush_cache: true`), where
        each engine checks that every parameter arrived. Returns the metrics; raises `EngineError` naming the
        engine URL and the engine's message when any engine refuses. Buckets are read one ahead (to know the
        last): a bucket's tensors must stay as they are while the next one is produced."""
        self._check_open()
        if not _is_count(version):
            raise ValueError(f"version must be a non-negative integer, got {version!r}")
        started = time.perf_counter()
        totals = {"weight_sync/bytes": 0.0, "weight_sync/buckets": 0.0, "weight_sync/tensors": 0.0}
        stream = _with_last(_checked(buckets, totals))
        if self.strategy == "distributed":
            self._ensure_group()
            for bucket, last in stream:
                self._broadcast_bucket(bucket, version, last)
        elif self.strategy == "tensor":
            self._send_tensor(stream, version)
        else:
            self._write_checkpoint(stream, version)
        return {**totals, "weight_sync/seconds": time.perf_counter() - started}

    def _broadcast_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: int, last: bool) -> None:
        group = self._group
        tensors = [self._wire_tensor(tensor) for _, tensor in bucket]
        names = [name for name, _ in bucket]
        dtypes, shapes = [dtype_name(t.dtype) for t in tensors], [list(t.shape) for t in tensors]
        replies = self._to_all(lambda client: client.update_weights_from_distributed(
            names, dtypes, shapes, group.name, version, last_bucket=last))
        route = "/update_weights_from_distributed"
        try:
            works = [dist.broadcast(tensor, src=0, group=group.group, async_op=True) for tensor in tensors]
        except RuntimeError as err:
            self._drop_group()
            raise self._failure(replies, route, f"broadcasting to the group failed ({err})") from err
        if not self._transfer_finished(works, replies):
            self._drop_group()
            raise self._failure(replies, route, "the broadcast did not complete: an engine left the group")
        self._raise_failures(replies)

    def _wire_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor as the backend broadcasts it: on this process's current GPU for nccl, on the CPU for gloo."""
        tensor = tensor.detach().contiguous()
        if self.backend == "gloo":
            return tensor.cpu()
        return tensor if tensor.is_cuda else tensor.to(torch.device("cuda", torch.cuda.current_device()))

    def _transfer_finished(self, works: list, replies: dict[str, concurrent.futures.Future]) -> bool:
        """Wait for the broadcasts; False when they cannot finish: an engine was unreachable, or every engine
        answered and the broadcasts still wait (one answered without receiving), or the time ran out."""
        deadline = time.monotonic() + self.timeout_s
        answered_at, pause = None, 0.0005
        while True:
            if any(reply.done() and isinstance(reply.exception(), EngineUnreachable) for reply in replies.values()):
                return False
            if all(work.is_completed() for work in works):
                try:
                    for work in works:
                        work.wait()
                except RuntimeError:
                    return False
                return True
            now = time.monotonic()
            if answered_at is None and all(reply.done() for reply in replies.values()):
                answered_at = now
            if now > deadline or (answered_at is not None and now - answered_at > TRANSFER_GRACE_S):
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def _send_tensor(self, stream: Iterator[tuple[list, bool]], version: int) -> None:
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
        shared = {url: packer.share(packed) for url in self.urls}  # one handle (and reference count) per engine
        replies = self._to_all(lambda client: client.update_weights_from_serialized(
            shared[client.url][0], CUDA_IPC_LOAD_FORMAT, version, last_bucket=last))
        return _InFlight(replies, {url: counter for url, (_, counter) in shared.items()})

    def _settle(self, in_flight: _InFlight | None, packer: CudaIpcPacker | None) -> None:
        """Wait for every engine's answer to a CUDA IPC bucket; raise an `EngineError` naming those that failed."""
        if in_flight is None:
            return
        concurrent.futures.wait(in_flight.replies.values())
        self._release_unopened(in_flight, packer)
        self._raise_failures(in_flight.replies)

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
            self._raise_failures(self._to_all(lambda client: client.update_weights_from_serialized(
                entry, SHARED_MEMORY_LOAD_FORMAT, version, last_bucket=last)))
        finally:
            os.unlink(path)

    def _write_checkpoint(self, stream: Iterator[tuple[list, bool]], version: int) -> None:
        from safetensors.torch import save_file

        directory = Path(tempfile.mkdtemp(prefix=f"rl360-weights-v{version}-", dir=self.scratch_dir))
        try:
            for index, (bucket, _) in enumerate(stream):
                save_file(_owning_copies(bucket), str(directory / f"shard-{index:05d}.safetensors"))
            self._raise_failures(self._to_all(lambda client: client.update_weights_from_disk(str(directory), version)))
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    # ---- the group ----
    def _ensure_group(self) -> None:
        if self._group is not None:
            return
        urls = self.urls
        world_size = 1 + sum(self._ranks[url] for url in urls)
        name = f"rl360-weights-{uuid.uuid4().hex[:16]}"
        store = host_store(self.master_address, world_size, self.timeout_s)
        offsets = [1 + sum(self._ranks[u] for u in urls[:i]) for i in range(len(urls))]
        offset_of = dict(zip(urls, offsets))
        route = "/init_weights_update_group"
        replies = self._to_all(lambda client: client.init_weights_update_group(
            self.master_address, store.port, offset_of[client.url], world_size, name, self.backend))
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                joined["group"] = open_process_group(self.backend, self.master_address, store.port, world_size, 0,
                                                     name, self.timeout_s, store=store)
            except Exception as err:  # handed to the waiting thread
                joined["error"] = err

        joiner = threading.Thread(target=join, name="rl360-weight-group-join", daemon=True)
        joiner.start()
        deadline = time.monotonic() + self.timeout_s
        while joiner.is_alive():  # an engine that fails to join leaves this thread to its own time-out
            if any(reply.done() and reply.exception() is not None for reply in replies.values()):
                raise self._failure(replies, route, "the weight-update group was not formed")
            if time.monotonic() > deadline:
                raise EngineTimeout(route, 0, f"the weight-update group was not formed within {self.timeout_s:g} s")
            joiner.join(0.01)
        if "error" in joined:
            context = f"joining the group at {self.master_address}:{store.port} failed ({joined['error']})"
            raise self._failure(replies, route, context) from joined["error"]
        self._group = _Group(name, joined["group"], urls)
        try:
            self._raise_failures(replies)
        except EngineError:
            self._close_group()
            raise

    def _close_group(self) -> None:
        """Destroy the group on its engines (errors ignored: an engine may be gone) and here."""
        group, self._group = self._group, None
        if group is None:
            return
        self._destroy_on_engines(group)
        close_process_group(group.group)

    def _drop_group(self) -> None:
        """Give up a group whose broadcasts cannot finish: its engines are told to destroy it, and this side is
        released on a daemon thread (the group's destructor waits for the pending broadcasts' time-out)."""
        group, self._group = self._group, None
        if group is None:
            return
        self._destroy_on_engines(group)
        holder, group.group = [group.group], None  # the thread's list holds the last reference
        threading.Thread(target=_release_process_group, args=(holder,), name="rl360-weight-group-release",
                         daemon=True).start()

    def _destroy_on_engines(self, group: _Group) -> None:
        timeout_s = min(DESTROY_TIMEOUT_S, self.timeout_s)
        replies = self._to_all(lambda client: client.destroy_weights_update_group(group.name, timeout_s=timeout_s),
                               urls=group.urls)
        concurrent.futures.wait(replies.values())  # failures ignored: a restarted engine has no such group

    # ---- requests ----
    def _to_all(self, call: Callable[[EngineClient], Coroutine], urls: list[str] | None = None
                ) -> dict[str, concurrent.futures.Future]:
        """`call(client)` on every engine (of `urls`) at once: futures by URL. A transport error (the engine is
        unreachable) becomes an `EngineError` naming the URL, like a refusal."""

        async def one(client: EngineClient) -> Any:
            try:
                return await call(client)
            except (httpx.TransportError, OSError) as err:
                raise EngineUnreachable("", 0, f"unreachable ({type(err).__name__}: {err})", url=client.url) from err

        return {url: self._loop.submit(one(self._clients[url])) for url in (self.urls if urls is None else urls)}

    def _raise_failures(self, replies: dict[str, concurrent.futures.Future]) -> None:
        """Wait for every reply; raise an `EngineError` naming every engine that failed."""
        concurrent.futures.wait(replies.values())
        if any(reply.exception() is not None for reply in replies.values()):
            raise self._failure(replies, "", "")

    @staticmethod
    def _failure(replies: dict[str, concurrent.futures.Future], route: str, context: str) -> EngineError:
        """One `EngineError` for the engines that failed so far (the first one's type, route, status and URL),
        with `context` first; `route` where none failed yet."""
        errors = [reply.exception() for reply in replies.values() if reply.done() and reply.exception() is not None]
        errors = [err if isinstance(err, EngineError) else EngineError(route, 0, repr(err)) for err in errors]
        if not errors:
            return EngineError(route, 0, context)
        first = errors[0]
        message = "; ".join(f"{err.url or '?'}: {err.message}" for err in errors)
        return type(first)(first.route or route, first.status, f"{context}: {message}" if context else message,
                           url=first.url)

    def _close_clients(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            self._loop.submit(client.close()).result()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this WeightSender is closed")


def _release_process_group(holder: list) -> None:
    close_process_group(holder[0])
    holder.clear()  # the group's destructor runs here, waiting for its pending broadcasts to time out


def _checked(buckets: Iterable[list[tuple[str, torch.Tensor]]], totals: dict[str, float]
             ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The buckets, each checked (a non-empty list of (name, tensor) with unique names), counted into totals."""
    seen: set[str] = set()
    for index, bucket in enumerate(buckets):
        if not isinstance(bucket, (list, tuple)) or not bucket:
            raise ValueError(f"bucket {index} must be a non-empty list of (name, tensor) pairs")
        for pair in bucket:
            if (not isinstance(pair, (list, tuple)) or len(pair) != 2 or not isinstance(pair[0], str)
                    or not isinstance(pair[1], torch.Tensor)):
                raise ValueError(f"bucket {index} holds {type(pair).__name__} where a (name, tensor) pair belongs")
            name, tensor = pair
            if name in seen:
                raise ValueError(f"weight {name!r} is sent twice in one update (again in bucket {index})")
            seen.add(name)
            dtype_name(tensor.dtype)
            totals["weight_sync/bytes"] += tensor.numel() * tensor.element_size()
        totals["weight_sync/buckets"] += 1
        totals["weight_sync/tensors"] += len(bucket)
        yield list(bucket)
    if not seen:
        raise ValueError("an update needs at least one bucket")


def _with_last(items: Iterator) -> Iterator[tuple[Any, bool]]:
    """Each item with whether it is the last (one item of look-ahead)."""
    iterator = iter(items)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield current, False
        current = following
    yield current, True
