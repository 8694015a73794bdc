"""Two data-parallel policy ranks for tests/test_distributed_optimizer.py (started by `run_ranks`): a few
updates with or without megatron's distributed optimizer, then each rank's weights, optimizer bytes and a
checkpoint, and the weights one update after it."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from rl360.actor.policy import PolicyWorker
from rl360.actor.settings import PolicySettings
from rl360.config import load_config
from tests.dp_worker import fixed_batch


def config(model_dir: str, dp: int, *extra: str):
    """One optimizer step per update (the mini-batch is the whole batch), so DP=1 and DP=2 steps are comparable."""
    return load_config(None, [f"model.path={model_dir}", "data.train_files=[unused.parquet]", "rollout.n=4",
                              "data.batch_size=4", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=4",
                              "actor.lr=1e-2", f"actor.parallel.data={dp}", *extra])


def train(worker: PolicyWorker, batch_rows: slice | None = None, steps: int = 3,
          first: int = 0) -> list[dict[str, float]]:
    """Updates `first` .. `first + steps - 1` on this rank's rows of the fixed batch (advantages grow each step)."""
    reports = []
    for step in range(first, first + steps):
        batch = fixed_batch()
        batch.advantages = batch.advantages * (1 + step)
        if batch_rows is not None:
            batch = batch.select(batch_rows)
        batch.old_logprobs = worker.compute_logprobs(batch) - 0.05
        reports.append(worker.update(batch))
    return reports


def flat_weights(worker: PolicyWorker) -> torch.Tensor:
    return torch.cat([param.detach().float().flatten() for chunk in worker.models for param in chunk.parameters()])


def main(model_dir: str, out_dir: str, extra: str = "") -> None:
    rank = int(os.environ["RANK"])
    worker = PolicyWorker(PolicySettings.of(config(model_dir, 2, *filter(None, extra.split(" ")))), rank=rank,
                          world_size=2, master_port=int(os.environ["MASTER_PORT"]))
    half = len(fixed_batch()) // 2
    reports = train(worker, slice(rank * half, (rank + 1) * half))
    torch.save(flat_weights(worker), f"{out_dir}/weights_rank{rank}.pt")
    held = worker.state_bytes()
    with open(f"{out_dir}/report_rank{rank}.json", "w") as f:
        json.dump({"reports": reports, "optimizer_bytes": held["optimizer"], "weights_bytes": held["weights"]}, f)
    worker.save_checkpoint(f"{out_dir}/ckpt")
    train(worker, slice(rank * half, (rank + 1) * half), steps=1, first=3)
    torch.save(flat_weights(worker), f"{out_dir}/weights_after_rank{rank}.pt")
    dist.barrier()
