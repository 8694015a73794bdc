"""A group of Ray actors placed one per bundle of a placement group (one bundle per GPU, or per CPU slot).

The controller calls the group and takes results from the ranks that own them; N=1 is the smallest group.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl360.cluster.placement import PlacementError
from rl360.errors import RunStopped
from rl360.network import free_port
from rl360.stopping import StopSignals, kill_descendants

STOP_GRACE_S = 10  # a run stopped by a signal: how long the processes it started have after SIGTERM, before SIGKILL


def start_ray(address: str = "", num_cpus: int = 0, num_gpus: int = -1) -> int:
    """Join `address` ("auto" or host:port), or start a local cluster when it is empty (`num_gpus` >= 0: that
    many GPUs declared, which on a CPU machine makes Ray place work as it would on GPUs); the cluster's GPUs.
    Empty, it is the environment's RAY_ADDRESS when set (a Slurm job's head), else a cluster of this process's
    own: never one another program on the machine started with `ray start` (which Ray would otherwise join)."""
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS", "")
        if address:
            ray.init(address=address, log_to_driver=True)
        else:
            ray.init(address="local", num_cpus=num_cpus or None, num_gpus=None if num_gpus < 0 else num_gpus,
                     include_dashboard=False, log_to_driver=True, configure_logging=False)
    return int(ray.cluster_resources().get("GPU", 0))


def stop_ray() -> None:
    """Disconnect from Ray; a local cluster that `start_ray` started stops with its processes."""
    if ray.is_initialized():
        ray.shutdown()


@contextmanager
def stopped_by_signals(checkpoints: Path) -> Iterator[StopSignals]:
    """SIGINT, SIGTERM and SIGUSR1 stop the run inside at its next safe point (rl360/stopping.py); when it ends so
    (RunStopped), nothing it started outlives the command: Ray is stopped and every process left of this one gets
    SIGTERM, then SIGKILL after STOP_GRACE_S."""
    stop = StopSignals(checkpoints)
    try:
        yield stop
    except RunStopped:
        stop_ray()
        kill_descendants(grace_s=STOP_GRACE_S)
        raise
    finally:
        stop.uninstall()


def reserve(bundles: list[dict[str, float]], name: str, timeout_s: float) -> PlacementGroup:
    """A placement group of `bundles`, ready; PlacementError naming what was asked and what the cluster has free
    when it is not ready within `timeout_s` (never a silent wait)."""
    group = placement_group(bundles, strategy="PACK", name=name)
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        asked = {key: sum(bundle.get(key, 0) for bundle in bundles) for key in ("GPU", "CPU")}
        free, total = ray.available_resources(), ray.cluster_resources()
        raise PlacementError(
            f"{name}: {len(bundles)} bundle(s) of {bundles[0]} ({asked['GPU']:g} GPU, {asked['CPU']:g} CPU in all) "
            f"not free within {timeout_s:g} s (cluster.placement_timeout_s); the cluster has "
            f"{total.get('GPU', 0):g} GPU and {total.get('CPU', 0):g} CPU, of which {free.get('GPU', 0):g} GPU and "
            f"{free.get('CPU', 0):g} CPU are free") from None
    return group


def _address_and_free_port() -> tuple[str, int]:
    return ray.util.get_node_ip_address(), free_port()


class WorkerGroup:
    """`world_size` actors of class `cls`, rank i on bundle i. With `distributed=True` each also gets
    `rank`, `world_size`, `master_addr` and `master_port` (rank 0's node and a port free there) to initialise
    torch.distributed with. `nodes[i]` is rank i's node, "hostname (address)"; a rank that dies fails a call
    with a RuntimeError naming its rank and node.

    The group reserves its bundles (PlacementError after `timeout_s` when the cluster cannot give them), or
    with `shared_group` shares the first `world_size` bundles of another group's; each actor then takes
    `share` of its bundle's GPU and CPUs (a colocated engine beside policy rank 0: half each, the same device)."""

    def __init__(self, cls: type, world_size: int, *args: Any, use_gpu: bool = False, cpus_per_rank: float = 1,
                 name: str = "workers", distributed: bool = True, share: float = 1.0,
                 shared_group: PlacementGroup | None = None, timeout_s: float = 60.0, **kwargs: Any):
        bundle = {"GPU": 1, "CPU": cpus_per_rank} if use_gpu else {"CPU": cpus_per_rank}
        self.owns_placement_group = shared_group is None
        self.placement_group = shared_group if shared_group is not None else \
            reserve([dict(bundle) for _ in range(world_size)], name, timeout_s)
        self.name = name
        on_node = {node["NodeID"]: f"{node['NodeManagerHostname']} ({node['NodeManagerAddress']})"
                   for node in ray.nodes()}
        bundle_nodes = ray.util.placement_group_table(self.placement_group)["bundles_to_node_id"]
        self.nodes = [on_node.get(bundle_nodes[rank], bundle_nodes[rank]) for rank in range(world_size)]
        if len(set(self.nodes)) > 1:
            print(f"{name}: {world_size} ranks on {len(set(self.nodes))} nodes: "
                  + ", ".join(f"rank {rank} on {node}" for rank, node in enumerate(self.nodes)), flush=True)
        remote_cls = ray.remote(cls)
        # torch.distributed's store lives with rank 0, which need not be on this (the driver's) node
        master_addr, master_port = ray.get(ray.remote(_address_and_free_port).options(
            num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=0)).remote())

        def rank_kwargs(rank: int) -> dict[str, Any]:
            if not distributed:
                return kwargs
            return dict(kwargs, rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port)

        self.actors = [
            remote_cls.options(
                num_cpus=cpus_per_rank * share,
                num_gpus=share if use_gpu else 0,
                # a worker Ray gave no GPU uses none (Ray leaves such a worker the node's CUDA_VISIBLE_DEVICES)
                **({} if use_gpu else {"runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}}),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank),
                name=f"{name}-{rank}",
            ).remote(*args, **rank_kwargs(rank))
            for rank in range(world_size)
        ]

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every rank and wait for all results (in rank order)."""
        return self.get([getattr(actor, method).remote(*args, **kwargs) for actor in self.actors])

    def call_each(self, method: str, per_rank_args: list[tuple]) -> list[Any]:
        """Call `method` on rank i with `per_rank_args[i]` and wait for all results (in rank order)."""
        return self.get([getattr(actor, method).remote(*args) for actor, args in zip(self.actors, per_rank_args)])

    def get(self, refs: list[ray.ObjectRef]) -> list[Any]:
        """`ray.get(refs)`; a rank that died (its process, or its node) is named with its node."""
        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as err:
            raise RuntimeError(f"{self.describe_death(err)}: {err}") from err

    def describe_death(self, err: ray.exceptions.RayActorError) -> str:
        """The rank `err` is about, as `<name> rank <i> on node <hostname> (<address>) died`."""
        for rank, actor in enumerate(self.actors):
            if err.actor_id == actor._actor_id.hex():
                return f"{self.name} rank {rank} on node {self.nodes[rank]} died"
        return f"a {self.name} rank died"

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        if self.owns_placement_group:
            remove_placement_group(self.placement_group)
