"""The controller's handle on the policy's TP x PP x DP rank actors.

Every rank of a data-parallel replica gets that replica's shard of a batch; results come back from the
ranks that hold them (the first tensor- and context-parallel rank of the last pipeline stage), one per replica, in
data-parallel order. Weight export runs on every rank of replica 0 (its gathers are collectives) while
rank 0 streams the buckets.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import ray

from rl360.actor.batch import RolloutBatch
from rl360.cluster import WorkerGroup


class PolicyGroup:
    def __init__(self, workers: WorkerGroup):
        """Returns at once: the ranks build in their processes (the engines can start meanwhile); the first call
        that needs their layouts waits for them."""
        self.workers = workers
        self.actors = workers.actors
        self._layouts: list[dict] | None = None

    def shutdown(self) -> None:
        """The ranks killed and their reservation freed (an in-process `train()` leaves Ray as it found it)."""
        if ray.is_initialized():
            self.workers.shutdown()

    @property
    def layouts(self) -> list[dict]:
        if self._layouts is None:
            layouts = self.workers.call("layout")
            returning = sorted((layout["dp_rank"], rank) for rank, layout in enumerate(layouts) if layout["returns"])
            if [dp for dp, _ in returning] != list(range(layouts[0]["dp_size"])):
                raise RuntimeError(f"expected one result rank per data-parallel replica, got layouts {layouts}")
            self._layouts, self._returning = layouts, returning
        return self._layouts

    @property
    def dp_size(self) -> int:
        return self.layouts[0]["dp_size"]

    def call(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every rank; the results in rank order."""
        return self.workers.call(method, *args)

    def shard_call(self, method: str, batch: RolloutBatch, *args: Any) -> list[Any]:
        """`method(shard, *args)` on every rank, replica i getting the i-th contiguous shard of `batch`;
        the results of the replicas' result ranks, in data-parallel order."""
        size = len(batch) // self.dp_size
        shards = [batch.select(slice(i * size, (i + 1) * size)) for i in range(self.dp_size)]
        layouts = self.layouts
        results = self.workers.call_each(method, [(shards[layout["dp_rank"]], *args) for layout in layouts])
        return [results[rank] for _, rank in self._returning]

    async def export_weights(self) -> AsyncIterator[ray.ObjectRef]:
        """References to the weight buckets, streamed from rank 0 while the rest of replica 0 takes part."""
        helpers = self._quiet_exports()
        async for bucket_ref in self.actors[0].export_weights.options(num_returns="streaming").remote():
            yield bucket_ref
        await asyncio.gather(*helpers)

    async def send_weights(self, urls: list[str], strategy: str, version: int, api_key: str | None,
                           scratch_dir: str) -> dict[str, float]:
        """Rank 0 exports straight into the engines at `urls` (`PolicyWorker.send_weights`), the rest of
        replica 0 taking part in the gathers; returns rank 0's transfer metrics."""
        helpers = self._quiet_exports()
        sent = await self.actors[0].send_weights.remote(urls, strategy, version, api_key, scratch_dir)
        await asyncio.gather(*helpers)
        return sent

    def _quiet_exports(self) -> list[ray.ObjectRef]:
        return [actor.export_weights_quietly.remote() for actor, layout in zip(self.actors, self.layouts)
                if layout["exports"] and actor is not self.actors[0]]

    def save_hf(self, out_dir: str) -> None:
        """Write the policy as a Hugging Face checkpoint (replica 0 takes part, global rank 0 writes)."""
        ray.get([actor.save_hf.remote(out_dir) for actor, layout in zip(self.actors, self.layouts)
                 if layout["exports"]])
