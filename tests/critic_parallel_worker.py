"""Critic ranks at TP x PP for tests/test_critic.py, started by `rl360.cluster.launch.run_ranks`."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from rl360.actor.critic import CriticWorker
from rl360.actor.settings import PolicySettings
from rl360.config import load_config
from tests.dp_worker import fixed_batch


def config(model_dir: str, mode: str, tp: int, pp: int, micro: int, cp: int = 1, sequence: bool = False,
           vpp: int = 1):
    return load_config(None, [f"model.path={model_dir}", "data.train_files=[unused.parquet]", "rollout.n=4",
                              "data.batch_size=4", "actor.ppo_mini_batch_size=4", f"actor.micro_batch_size={micro}",
                              f"actor.loss_agg_mode={mode}", "critic.cliprange_value=0.02",
                              f"actor.parallel.tensor={tp}", f"actor.parallel.pipeline={pp}",
                              f"actor.parallel.context={cp}", f"actor.parallel.sequence={str(sequence).lower()}",
                              f"actor.parallel.virtual_pipeline={vpp}"])


def values_and_gradient(worker: CriticWorker) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Values of the fixed batch under a non-zero value head, then the gradient of one mini-batch of the
    clipped value loss: the body's in HF names (gathered through the bridge), the head's as `value_head.*`
    (on the ranks of the last stage, which hold the head)."""
    model = worker.models[-1].module
    gen = torch.Generator().manual_seed(0)
    head_weight = 0.05 * torch.randn(1, model.config.hidden_size, generator=gen)
    if model.post_process:
        with torch.no_grad():
            model.output_layer.weight.copy_(head_weight)
    batch = fixed_batch()
    values = worker.compute_values(batch)
    noise = torch.randn(batch.response_mask.shape, generator=gen)
    batch.values = 0.2 * noise * batch.response_mask  # old values the same on every rank, some of them clipped
    batch.returns = 0.1 * torch.randn(batch.response_mask.shape, generator=gen) * batch.response_mask
    worker.accumulate_gradients(batch)
    gradient = {}
    if model.post_process:
        gradient = {f"value_head.{name}": param.main_grad.detach().cpu().clone()
                    for name, param in model.output_layer.named_parameters()}
    return values, {**gradient, **_body_gradient_as_hf(worker)}


def _body_gradient_as_hf(worker: CriticWorker) -> dict[str, torch.Tensor]:
    """The body's accumulated gradient in HF names and layout, through the bridge (with tied embeddings it
    exports no output layer, so the value head is set aside for the export)."""
    models = [m.module for m in worker.models]
    heads = [model.output_layer if model.post_process else None for model in models]
    for model in models:
        for param in model.parameters():
            param.data.copy_(param.main_grad)
        if model.post_process:
            model.output_layer = None
    try:
        return {name: t for bucket in worker.bridge.export_hf_weights(models) for name, t in bucket}
    finally:
        for model, head in zip(models, heads):
            if head is not None:
                model.output_layer = head


def main(model_dir: str, out_dir: str, mode: str, tp: str, pp: str, micro: str, cp: str = "1",
         sequence: str = "0", vpp: str = "1") -> None:
    cfg = config(model_dir, mode, int(tp), int(pp), int(micro), int(cp), sequence == "1", int(vpp))
    worker = CriticWorker(PolicySettings.of(cfg), rank=int(os.environ["RANK"]),
                          world_size=int(os.environ["WORLD_SIZE"]), master_port=int(os.environ["MASTER_PORT"]))
    values, gradient = values_and_gradient(worker)
    rank = dist.get_rank()
    save_file(gradient, f"{out_dir}/gradient_rank{rank}.safetensors")
    if values is not None:
        torch.save(values, f"{out_dir}/values_rank{rank}.pt")
