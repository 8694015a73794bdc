"""LoRA policy ranks at TP=2 for tests/test_lora.py, started by `rl360.cluster.launch.run_ranks`: gradients of the
adapters and of the whole model at the merged weights, the merged export, and training with a checkpoint and an
exact resume."""

from __future__ import annotations

import json
import os
import zlib

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from rl360.actor.policy import PolicyWorker
from rl360.actor.settings import PolicySettings
from rl360.config import load_config
from tests.dp_worker import fixed_batch
from tests.policy_parallel_worker import gradient_as_hf, train_pipelined, weights_as_hf

RANK, ALPHA = 4, 8.0


def config(model_dir: str, tp: int, *extra: str):
    return load_config(None, [f"model.path={model_dir}", "data.train_files=[unused.parquet]", "rollout.n=4",
                              "data.batch_size=4", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=3",
                              "actor.entropy_coeff=0.01", "actor.lr=0.01", f"actor.parallel.tensor={tp}", *extra])


def lora_config(model_dir: str, tp: int, *extra: str):
    return config(model_dir, tp, f"actor.lora.rank={RANK}", f"actor.lora.alpha={ALPHA}",
                  "actor.lora.targets=[all-linear]", *extra)


def randomize_b(worker: PolicyWorker) -> None:
    """Non-zero B matrices (PEFT starts them at zero, which would hide A's gradient): each split shard its own
    draw, each replicated one the same draw on every tensor-parallel rank."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for name, param in worker.models[0].module.named_parameters():
        if ".lora_B." in name:
            split = getattr(param, "tensor_model_parallel", False)
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode()) + (tp_rank if split else 0))
            param.data.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def old_logprobs(worker: PolicyWorker, batch) -> torch.Tensor:
    """The batch's log-probs from the last pipeline stage, on every rank, shifted so the ratio is not 1."""
    logprobs = [worker.compute_logprobs(batch)]
    dist.broadcast_object_list(logprobs, src=dist.get_world_size() - 1)
    return logprobs[0] - 0.05


def gradients_and_export(model_dir: str, out_dir: str, extra: tuple[str, ...] = ()) -> PolicyWorker:
    """The adapters' gradient, the merged export, and the whole model's gradient at the merged weights."""
    rank = int(os.environ["RANK"])
    worker = PolicyWorker(PolicySettings.of(lora_config(model_dir, 2, *extra)), rank=rank,
                          world_size=int(os.environ["WORLD_SIZE"]), master_port=int(os.environ["MASTER_PORT"]))
    randomize_b(worker)
    before = worker.lora_state()
    merged = weights_as_hf(worker)
    merged_dir = f"{out_dir}/merged"
    worker.save_hf(merged_dir)
    batch = fixed_batch()
    batch.old_logprobs = old_logprobs(worker, batch)
    worker.accumulate_gradients(batch)
    lora_gradient = worker.lora_state(gradients=True)
    full = PolicyWorker(PolicySettings.of(config(merged_dir, 2, *extra)), rank=rank,
                        world_size=int(os.environ["WORLD_SIZE"]), master_port=int(os.environ["MASTER_PORT"]))
    full.accumulate_gradients(batch)
    full_gradient = gradient_as_hf(full)
    if rank == 0:
        trainable = [p.numel() for p in worker.models[0].parameters() if p.requires_grad]
        with open(f"{out_dir}/trainable.json", "w") as f:
            json.dump({"parameters": sum(trainable), "tensors": len(trainable),
                       "frozen": sum(p.numel() for p in worker.models[0].parameters() if not p.requires_grad)}, f)
        save_file(before, f"{out_dir}/adapters.safetensors")
        save_file(merged, f"{out_dir}/merged.safetensors")
        save_file(lora_gradient, f"{out_dir}/lora_gradient.safetensors")
        save_file(full_gradient, f"{out_dir}/full_gradient.safetensors")
    del full
    return worker


def gradients_only(model_dir: str, out_dir: str, extra: str) -> None:
    """`gradients_and_export` at another layout (`extra`: overrides such as sequence or pipeline parallelism)."""
    gradients_and_export(model_dir, out_dir, tuple(extra.split(" ")))


def main(model_dir: str, out_dir: str) -> None:
    worker = gradients_and_export(model_dir, out_dir)
    rank = dist.get_rank()
    train_pipelined(worker, steps=2)
    worker.save_checkpoint(f"{out_dir}/ckpt")
    saved = worker.lora_state()
    train_pipelined(worker, steps=1, first=2)
    unbroken = worker.lora_state()
    resumed = PolicyWorker(PolicySettings.of(lora_config(model_dir, 2)), rank=rank,
                           world_size=int(os.environ["WORLD_SIZE"]), master_port=int(os.environ["MASTER_PORT"]))
    resumed.load_checkpoint(f"{out_dir}/ckpt")
    loaded = resumed.lora_state()
    train_pipelined(resumed, steps=1, first=2)
    if rank == 0:
        for name, tensors in (("saved", saved), ("unbroken", unbroken), ("loaded", loaded),
                              ("resumed", resumed.lora_state())):
            save_file(tensors, f"{out_dir}/{name}.safetensors")
    else:
        resumed.lora_state()
