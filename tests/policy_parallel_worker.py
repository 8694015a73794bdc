"""Policy ranks at TP x PP (or EP) for tests/test_policy_parallel.py and tests/test_policy_moe.py, started by
`rl360.cluster.launch.run_ranks`."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from rl360.actor.policy import PolicyWorker
from rl360.actor.settings import PolicySettings
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
    cfg = config(model_dir, mode, int(tp), int(pp), int(micro), *filter(None, extra.split(" ")))
    worker = PolicyWorker(PolicySettings.of(cfg), rank=int(os.environ["RANK"]),
                          world_size=int(os.environ["WORLD_SIZE"]), master_port=int(os.environ["MASTER_PORT"]))
    logprobs, gradient = logprobs_and_gradient(worker)
    rank = dist.get_rank()
    save_file(gradient, f"{out_dir}/gradient_rank{rank}.safetensors")
    if logprobs is not None:
        torch.save(logprobs, f"{out_dir}/logprobs_rank{rank}.pt")


def weights_as_hf(worker: PolicyWorker) -> dict[str, torch.Tensor]:
    return {name: t for bucket in worker.export_weights() for name, t in bucket}


def train_pipelined(worker: PolicyWorker, steps: int = 3, first: int = 0) -> list[dict[str, float]]:
    """`tests.zero_worker.train` for a pipeline: the old log-probs come from the last stage to every rank."""
    reports = []
    for step in range(first, first + steps):
        batch = fixed_batch()
        batch.advantages = batch.advantages * (1 + step)
        logprobs = [worker.compute_logprobs(batch)]
        dist.broadcast_object_list(logprobs, src=dist.get_world_size() - 1)
        batch.old_logprobs = logprobs[0] - 0.05
        reports.append(worker.update(batch))
    return reports


def train_and_checkpoint(model_dir: str, out_dir: str, tp: str, pp: str, extra: str = "") -> None:
    """3 updates of the fixed batch at TP x PP (`extra`: more overrides), the weights then (HF names) and a
    checkpoint, then a 4th update and the weights after it; the last rank writes its reports."""
    from tests.zero_worker import config as one_step_config

    cfg = one_step_config(model_dir, 1, f"actor.parallel.tensor={tp}", f"actor.parallel.pipeline={pp}",
                          *filter(None, extra.split(" ")))
    worker = PolicyWorker(PolicySettings.of(cfg),
                          rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                          master_port=int(os.environ["MASTER_PORT"]))
    rank = dist.get_rank()
    reports = train_pipelined(worker)
    weights = weights_as_hf(worker)
    worker.save_checkpoint(f"{out_dir}/ckpt")
    reports += train_pipelined(worker, steps=1, first=3)
    after = weights_as_hf(worker)
    if rank == 0:
        save_file(weights, f"{out_dir}/weights.safetensors")
        save_file(after, f"{out_dir}/weights_after.safetensors")
    if rank == dist.get_world_size() - 1:
        torch.save(reports, f"{out_dir}/reports.pt")
    dist.barrier()


def _expert_parallel_worker(model_dir: str, mode: str, micro: int, extra: str = "", dp: int = 2,
                            ep: int = 2) -> PolicyWorker:
    cfg = config(model_dir, mode, 1, 1, micro, f"actor.parallel.data={dp}", f"actor.parallel.expert={ep}",
                 *filter(None, extra.split(" ")))
    return PolicyWorker(PolicySettings.of(cfg),
                        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                        master_port=int(os.environ["MASTER_PORT"]))


def _share(rank: int, ranks: int = 2):
    """Data-parallel rank `rank`'s contiguous share of the fixed batch."""
    batch = fixed_batch()
    size = len(batch) // ranks
    return batch.select(slice(rank * size, (rank + 1) * size))


def expert_parallel(model_dir: str, out_dir: str, mode: str, micro: str, extra: str = "", dp: str = "2",
                    ep: str = "2") -> None:
    """`dp` data-parallel ranks at EP=`ep`, each with its share of the fixed batch: its log-probs and the
    (all-reduced) gradient."""
    worker = _expert_parallel_worker(model_dir, mode, int(micro), extra, int(dp), int(ep))
    rank = dist.get_rank()
    # the first EP group (ranks 0 .. ep-1: EP varies faster than expert-data-parallel) holds every expert once
    assert worker.layout()["exports"] == (rank < int(ep))
    mine = _share(rank, int(dp))
    logprobs = worker.compute_logprobs(mine)
    reference = worker.compute_logprobs(mine, True)
    mine.old_logprobs, mine.ref_logprobs = logprobs - 0.05, reference + 0.02
    worker.accumulate_gradients(mine)
    save_file(gradient_as_hf(worker), f"{out_dir}/gradient_rank{rank}.safetensors")
    torch.save(logprobs, f"{out_dir}/logprobs_rank{rank}.pt")


def expert_parallel_checkpoint(model_dir: str, out_dir: str, extra: str = "") -> None:
    """EP=2: one update, the policy's checkpoint saved to `out_dir`/ckpt, weights and optimizer state spoiled and
    loaded back (each rank checks them against what it saved); rank 0 writes the whole model as exported then.
    Each rank also writes the bytes its optimizer state holds."""
    from megatron_bridge.checkpoint import write_checkpoint_info

    worker = _expert_parallel_worker(model_dir, "token-mean", 3, extra)
    rank = dist.get_rank()
    mine = _share(rank)
    mine.old_logprobs = worker.compute_logprobs(mine) - 0.05
    mine.ref_logprobs = worker.compute_logprobs(mine, True)
    assert worker.update(mine)["actor/grad_norm"] > 0
    (Path(out_dir) / f"optimizer_bytes_rank{rank}.txt").write_text(str(worker.state_bytes()["optimizer"]))
    def state() -> list[tuple[str, torch.Tensor]]:  # (loading the optimizer replaces its state tensors: fetched anew)
        out = [(name, param) for name, param in worker.models[0].named_parameters()]
        for part in getattr(worker.optimizer, "chained_optimizers", [worker.optimizer]):
            inner = part.optimizer
            for group in inner.param_groups:
                for param in group["params"]:
                    out += [(f"{tuple(param.shape)} {key}", value)
                            for key, value in sorted(inner.state.get(param, {}).items()) if torch.is_tensor(value)]
        return out

    saved = [(name, tensor.detach().clone()) for name, tensor in state()]
    worker.save_checkpoint(f"{out_dir}/ckpt")
    if rank == 0:
        write_checkpoint_info(f"{out_dir}/ckpt", worker.bridge, 1, 1, "float32", model_state_key="model")
    with torch.no_grad():
        for _, tensor in state():
            tensor.add_(1.0)
    worker.load_checkpoint(f"{out_dir}/ckpt")
    for (name, tensor), (saved_name, before) in zip(state(), saved, strict=True):
        assert name == saved_name and torch.equal(tensor, before), f"rank {rank}: {name} not restored"
    exported = {name: t for bucket in worker.export_weights() for name, t in bucket}
    if rank == 0:
        save_file(exported, f"{out_dir}/exported.safetensors")
