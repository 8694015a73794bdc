"""The weight-update process group, made the same way on both sides: by the sender (rank 0) and by every
engine that joins it (`rl360 serve rollout`, like SGLang's `init_custom_process_group`)."""

from __future__ import annotations

import contextlib
import datetime

import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


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

