"""A data-parallel policy rank for tests/test_policy.py, run in its own process."""

import sys

import torch

from rl360.actor.batch import build_batch
from rl360.actor.policy import PolicyWorker
from rl360.actor.settings import PolicySettings
from rl360.config import load_config


def fixed_batch(count: int = 16) -> tuple:
    """A deterministic batch of prompt/response token lists with advantages (no engine needed)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(count)]
    responses = [torch.randint(3, 90, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen).tolist()
                 for _ in range(count)]
    batch = build_batch(prompts, responses, [[0.0] * len(r) for r in responses])
    batch.advantages = torch.randn(count, 1, generator=gen) * batch.response_mask
    return batch


def config(model_dir: str, mode: str, loss: str, dp: int):
    return load_config(None, [f"model.path={model_dir}", "data.train_files=[unused.parquet]", "rollout.n=4",
                              "data.batch_size=4", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=3",
                              f"actor.loss_agg_mode={mode}", f"actor.loss_mode={loss}", f"actor.parallel.data={dp}",
                              "actor.entropy_coeff=0.01"])


def gradient(worker: PolicyWorker, batch) -> torch.Tensor:
    batch.old_logprobs = worker.compute_logprobs(batch) - 0.05
    worker.accumulate_gradients(batch)
    return torch.cat([p.main_grad.flatten().cpu() for p in worker.models[0].parameters()])


def main(model_dir: str, mode: str, loss: str, rank: int, port: int, out: str) -> None:
    worker = PolicyWorker(PolicySettings.of(config(model_dir, mode, loss, 2)), rank=rank, world_size=2,
                          master_port=port)
    batch = fixed_batch()
    half = len(batch) // 2
    torch.save(gradient(worker, batch.select(slice(rank * half, (rank + 1) * half))), out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
