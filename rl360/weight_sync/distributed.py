"""`distributed`: a torch.distributed group between the sender (rank 0) and every engine (engine i's ranks start
at `1 + sum(engine_ranks[:i])`; an SGLang engine with tensor parallelism 2 has 2 ranks), created on the first
send after the engines were set: the sender hosts a TCP store on a free port of `master_address`, POSTs
`/init_weights_update_group` (SGLang's fields) to every engine while joining the group itself, under a group
name new for each creation. Per bucket it POSTs `/update_weights_from_distributed` (`names`, `dtypes` as SGLang
spells them: "float32", "bfloat16", ..., `shapes`, `group_name`, `flush_cache`, `weight_version`) to every
engine, broadcasts each tensor from rank 0 in the order of `names`, then waits for every reply. `backend` "gloo"
sends CPU tensors (CUDA tensors are copied to the CPU first), "nccl" CUDA tensors (CPU tensors are copied to the
current GPU first).

An engine that fails before receiving every tensor (unreachable, or refusing at once: every engine answered and
the broadcasts still wait after TRANSFER_GRACE_S) leaves the group unusable: it is dropped (the next send
creates a new one). Engines that refuse after receiving (an old version, missing weights) leave it usable.
`reset` POSTs `/destroy_weights_update_group` to the engines still reachable and destroys this side. The group
is made exactly as SGLang's engine makes its side (`group.open_process_group`), so real SGLang engines take it.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rl360.core.client import EngineError, EngineTimeout
from rl360.errors import ConfigError
from rl360.weight_sync.calls import EngineCalls, EngineUnreachable, failure
from rl360.weight_sync.flat_bucket import dtype_name
from rl360.weight_sync.group import close_process_group, host_store, open_process_group
from rl360.weight_sync.registry import SyncOptions, register_strategy

TRANSFER_GRACE_S = 2.0  # after every engine answered, broadcasts still pending this long mean the group broke
DESTROY_TIMEOUT_S = 10.0


@dataclass
class _Group:
    name: str
    group: dist.ProcessGroup
    urls: list[str]


@register_strategy("distributed", summary="a gloo/NCCL group between the trainer's export rank and every engine, "
                   "one broadcast per tensor", engines=("server", "sglang"), shares_gpu=False,
                   gpu_note="NCCL refuses two ranks of one group on one GPU")
class DistributedSync:
    def __init__(self, calls: EngineCalls, backend: str, master_address: str, timeout_s: float):
        self.calls, self.backend, self.master_address, self.timeout_s = calls, backend, master_address, timeout_s
        self._group: _Group | None = None

    @classmethod
    def from_options(cls, calls: EngineCalls, options: SyncOptions) -> DistributedSync:
        if options.backend == "nccl" and not torch.cuda.is_available():
            raise ConfigError("weight sync backend 'nccl' needs CUDA, which this process does not have: use 'gloo'")
        return cls(calls, options.backend, options.master_address, options.timeout_s)

    @property
    def group_name(self) -> str | None:
        """The open weight-update group's name (None before the first send)."""
        return self._group.name if self._group else None

    def send(self, stream: Iterator[tuple[list, bool]], version: int) -> None:
        self._ensure_group()
        for bucket, last in stream:
            self._broadcast_bucket(bucket, version, last)

    def reset(self) -> None:
        """Destroy the group on its engines (errors ignored: an engine may be gone) and here."""
        group, self._group = self._group, None
        if group is None:
            return
        self._destroy_on_engines(group)
        close_process_group(group.group)

    def _broadcast_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: int, last: bool) -> None:
        group = self._group
        tensors = [self._wire_tensor(tensor) for _, tensor in bucket]
        names = [name for name, _ in bucket]
        dtypes, shapes = [dtype_name(t.dtype) for t in tensors], [list(t.shape) for t in tensors]
        replies = self.calls.to_all(lambda client: client.update_weights_from_distributed(
            names, dtypes, shapes, group.name, version, last_bucket=last))
        route = "/update_weights_from_distributed"
        try:
            works = [dist.broadcast(tensor, src=0, group=group.group, async_op=True) for tensor in tensors]
        except RuntimeError as err:
            self._drop_group()
            raise failure(replies, route, f"broadcasting to the group failed ({err})") from err
        if not self._transfer_finished(works, replies):
            self._drop_group()
            raise failure(replies, route, "the broadcast did not complete: an engine left the group")
        self.calls.raise_failures(replies)

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


    def _ensure_group(self) -> None:
        if self._group is not None:
            return
        urls = self.calls.urls
        world_size = 1 + sum(self.calls.ranks[url] for url in urls)
        name = f"rl360-weights-{uuid.uuid4().hex[:16]}"
        store = host_store(self.master_address, world_size, self.timeout_s)
        offsets = [1 + sum(self.calls.ranks[u] for u in urls[:i]) for i in range(len(urls))]
        offset_of = dict(zip(urls, offsets))
        route = "/init_weights_update_group"
        replies = self.calls.to_all(lambda client: client.init_weights_update_group(
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
                raise failure(replies, route, "the weight-update group was not formed")
            if time.monotonic() > deadline:
                raise EngineTimeout(route, 0, f"the weight-update group was not formed within {self.timeout_s:g} s")
            joiner.join(0.01)
        if "error" in joined:
            context = f"joining the group at {self.master_address}:{store.port} failed ({joined['error']})"
            raise failure(replies, route, context) from joined["error"]
        self._group = _Group(name, joined["group"], urls)
        try:
            self.calls.raise_failures(replies)
        except EngineError:
            self.reset()
            raise


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
        replies = self.calls.to_all(lambda client: client.destroy_weights_update_group(group.name, timeout_s=timeout_s),
                               urls=group.urls)
        concurrent.futures.wait(replies.values())  # failures ignored: a restarted engine has no such group



def _release_process_group(holder: list) -> None:
    close_process_group(holder[0])
    holder.clear()  # the group's destructor runs here, waiting for its pending broadcasts to time out


