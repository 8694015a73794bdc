"""torch.distributed and megatron parallel state for one policy rank."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from rl360.actor.cpu_compat import activate_cpu_compat
from rl360.network import free_port


def init_parallel(tensor_parallel: int = 1, pipeline_parallel: int = 1, seed: int = 0,
                  context_parallel: int = 1, virtual_pipeline: int = 1, expert_parallel: int = 1) -> None:
    """Initialise torch.distributed (gloo on CPU, nccl on CUDA) and megatron's TP x CP x PP x DP groups, with
    `virtual_pipeline` model chunks per pipeline rank (megatron's interleaved schedule) when it is > 1, and for a
    mixture of experts its expert groups: EP ranks taken from DP x CP, each holding 1/EP of the experts (their
    gradients averaged over the remaining expert-data-parallel ranks).

    Rank and world size come from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, defaulting to a single
    process. Calling it again with the same sizes does nothing.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    activate_cpu_compat()
    if parallel_state.model_parallel_is_initialized():
        sizes = (parallel_state.get_tensor_model_parallel_world_size(),
                 parallel_state.get_pipeline_model_parallel_world_size(),
                 parallel_state.get_context_parallel_world_size(),
                 parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
                 parallel_state.get_expert_model_parallel_world_size())
        if sizes != (tensor_parallel, pipeline_parallel, context_parallel, virtual_pipeline, expert_parallel):
            raise RuntimeError(f"megatron parallel state already initialised with TP x PP x CP x VPP x EP = {sizes}")
        return
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if not os.environ.get("MASTER_PORT") or os.environ["MASTER_PORT"] == "0":
            os.environ["MASTER_PORT"] = str(free_port())
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank, world_size=world,
                                timeout=timedelta(minutes=30))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                             pipeline_model_parallel_size=pipeline_parallel,
                                             context_parallel_size=context_parallel,
                                             virtual_pipeline_model_parallel_size=virtual_pipeline
                                             if virtual_pipeline > 1 else None,
                                             expert_model_parallel_size=expert_parallel)
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """A model chunk without megatron's DistributedDataParallel wrapper (the chunk itself when unwrapped)."""
    return getattr(model, "module", model)
