"""The policy's model: its chunks built from model.path through the bridge (recomputation, sequence and context
parallelism, MoE settings and routing replay, LoRA adapters, a frozen vision tower), wrapped in megatron's
DistributedDataParallel, and the optimizer over them.

`PolicyModel._build_model` is a part of `rl360.actor.policy.PolicyWorker` (the critic builds its own); it reads the
worker's `settings`, `bridge`, `attention`, `replay`, `device` and `lora`.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig

from megatron_bridge.lora import LoraSpec, attach_adapters, expand_targets
from rl360.actor.routing_replay import RoutingReplay
from rl360.actor.settings import PolicySettings
from rl360.config import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# actor.recompute -> megatron's activation recomputation: none keeps every activation for the backward pass;
# selective recomputes core attention (its softmax inputs are the largest activations of long sequences);
# full keeps only each layer's input and recomputes the layer in the backward pass
RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


class PolicyModel:
    def _build_model(self, dtype: torch.dtype, adapters: bool = False) -> list:
        """This rank's model chunks from model.path; with `adapters` and actor.lora.rank > 0 the base frozen and
        LoRA adapters added (the reference model stays the base)."""
        chunks = self.bridge.to_megatron_model(load_weights=True, params_dtype=dtype,
                                               training={**RECOMPUTE[self.settings.actor.recompute],
                                                         "sequence_parallel": self.settings.actor.parallel.sequence,
                                                         "cp_comm_type": self.settings.actor.parallel.cp_comm_type,
                                                         "moe_aux_loss_coeff": self.settings.actor.moe_aux_loss_coef,
                                                         **({"moe_enable_routing_replay": True} if self.replay
                                                            else {})},
                                               attention=self.attention)
        if self.settings.actor.parallel.pipeline > 1:  # micro-batches differ in size and length: stages send
            for chunk in chunks:                   # each activation's shape before the activation
                chunk.config.variable_seq_lengths = True
                # gloo: a tag per direction between stages (see rl360/actor/cpu_compat.py, ring_exchange)
                chunk.config.use_ring_exchange_p2p = self.device.type == "cpu"
        if self.settings.actor.freeze_vision_tower:  # before DDP: frozen parameters get no gradient buffer
            for chunk in chunks:
                if hasattr(chunk, "vision"):
                    chunk.vision.requires_grad_(False)
        if adapters and self.lora is not None:  # before DDP: only the adapters get gradient buffers
            for chunk in chunks:
                attach_adapters(chunk, self.lora, self.settings.seed)
        return chunks


def wrap_ddp(chunks: list, distributed_optimizer: bool) -> list:
    """Megatron DDP: gradients in contiguous buffers, all-reduced (reduce-scattered for the distributed
    optimizer) over data-parallel ranks by the schedule's `finalize_model_grads` at the end of each mini-batch."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=distributed_optimizer)
    wrapped = [DistributedDataParallel(chunk.config, ddp_config, chunk) for chunk in chunks]
    for chunk in wrapped:
        chunk.config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def build_optimizer(settings: PolicySettings, optimizer, models: list):
    """Megatron's Adam over `models` with `optimizer`'s lr, weight_decay, betas and grad_clip (actor.* or critic.*)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=optimizer.lr, weight_decay=optimizer.weight_decay, adam_beta1=optimizer.betas[0],
        adam_beta2=optimizer.betas[1], clip_grad=optimizer.grad_clip, bf16=settings.model.dtype == "bfloat16",
        params_dtype=DTYPES[settings.model.dtype], use_distributed_optimizer=settings.actor.distributed_optimizer,
    )
    return get_megatron_optimizer(config, models)


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """The tensors megatron's optimizer holds beyond the model: the parameters its torch optimizers step (fp32
    main weights for bf16 models, shards of them for the distributed optimizer; fp32 models' own parameters
    otherwise) and their Adam state."""
    tensors = []
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = part.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                tensors.append(param)
                tensors += [value for value in inner.state.get(param, {}).values() if torch.is_tensor(value)]
    return tensors


def lora_spec(settings: PolicySettings) -> LoraSpec | None:
    """actor.lora as the adapters' spec (None when rank is 0)."""
    lora = settings.actor.lora
    if not lora.rank:
        return None
    return LoraSpec(lora.rank, float(lora.alpha), float(lora.dropout), expand_targets(list(lora.targets)))


def routing_replay(settings: PolicySettings) -> RoutingReplay | None:
    """The routers' replay of the engine's experts when actor.moe_routing_replay is on (ConfigError for a model
    without experts)."""
    if not settings.actor.moe_routing_replay:
        return None
    config = AutoConfig.from_pretrained(settings.model.path)
    config = getattr(config, "text_config", config)
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    if not top_k:
        raise ConfigError(f"actor.moe_routing_replay=true: {settings.model.path} is not a mixture of experts "
                          f"({config.model_type}, no num_experts_per_tok)")
    return RoutingReplay(int(config.num_hidden_layers), top_k)
