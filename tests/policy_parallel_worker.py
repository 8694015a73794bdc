"""Policy ranks at TP x PP (or EP) for tests/test_policy_parallel.py and tests/test_policy_moe.py, started by
`rl360.cluster.launch.run_ranks`."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from rl360.actor.policy import PolicyWorker
from rl360.config import load_config
from tests.dp_worker import fixed_batch


def config(model_dir: str, mode: str, tp: int, pp: int, micro: int, *extra: str):
    return load_config(None, [f"model.path={model_dir}", "data.train_files=[unused.parquet]", "rollout.n=4",
                              "data.batch_size=4", "actor.ppo_mini_batch_size=4", f"actor.micro_batch_size={micro}",
                              f"actor.loss_agg_mode={mode}", "actor.entropy_coeff=0.01", "algorithm.kl_coef=0.01",
                              f"actor.parallel.tensor={tp}", f"actor.parallel.pipeline={pp}", *extra])


def gradient_as_hf(worker: PolicyWorker) -> dict[str, torch.Tensor]:
    """The accumulated gradient in HF names and layout (gathered like weights, through the bridge)."""
    models = [m.module for m in worker.models]
    for model in models:
        for param in model.parameters():
            param.data.copy_(param.main_grad)
    return {name: t for bucket in worker.bridge.export_hf_weights(models) for name, t in bucket}


def logprobs_and_gradient(worker: PolicyWorker) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Log-probs of the fixed batch, then the gradient of one mini-batch on it (KL to the reference, entropy)."""
    batch = fixed_batch()
    logprobs = worker.compute_logprobs(batch)
    reference = worker.compute_logprobs(batch, True)
    shape = (len(batch), batch.response_mask.shape[1])
    batch.old_logprobs = (logprobs if logprobs is not None else torch.zeros(shape)) - 0.05
    batch.ref_logprobs = (reference if reference is not None else torch.zeros(shape)) + 0.02
    worker.accumulate_gradients(batch)
    return logprobs, gradient_as_hf(worker)


def main(model_dir: str, out_dir: str, mode: str, tp: str, pp: str, micro: str, extra: str = "") -> None:
    worker = PolicyWorker(config(model_dir, mode, int(tp), int(pp), int(micro), *filter(None, extra.split(" "))),
                          rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                          master_port=int(os.environ["MASTER_PORT"]))
    logprobs, gradient = logprobs_and_gradient(worker)
    rank = dist.get_rank()
    save_file(gradient, f"{out_dir}/gradient_rank{rank}.safetensors")
    if logprobs is not None:
        torch.save(logprobs, f"{out_dir}/logprobs_rank{rank}.pt")


def expert_parallel(model_dir: str, out_dir: str, mode: str, micro: str, extra: str = "") -> None:
    """Two data-parallel ranks at EP=2, each with its half of the fixed batch: its log-probs, the (all-reduced)
    gradient, and a checkpoint of the policy saved to `out_dir`/ckpt."""
    from megatron_bridge.checkpoint import write_checkpoint_info

    worker = PolicyWorker(config(model_dir, mode, 1, 1, int(micro), "actor.parallel.data=2", "actor.parallel.expert=2",
                                 *filter(None, extra.split(" "))),
                          rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                          master_port=int(os.environ["MASTER_PORT"]))
    rank = dist.get_rank()
    assert worker.layout()["exports"]  # the two EP ranks together hold every expert: both take part
    batch = fixed_batch()
    half = len(batch) // 2
    mine = batch.select(slice(rank * half, (rank + 1) * half))
    logprobs = worker.compute_logprobs(mine)
    reference = worker.compute_logprobs(mine, True)
    mine.old_logprobs, mine.ref_logprobs = logprobs - 0.05, reference + 0.02
    worker.save_checkpoint(f"{out_dir}/ckpt")  # before the gradient lands in the weights (see gradient_as_hf)
    if rank == 0:
        write_checkpoint_info(f"{out_dir}/ckpt", worker.bridge, 1, 1, "float32", model_state_key="model")
    worker.accumulate_gradients(mine)
    save_file(gradient_as_hf(worker), f"{out_dir}/gradient_rank{rank}.safetensors")
    torch.save(logprobs, f"{out_dir}/logprobs_rank{rank}.pt")
