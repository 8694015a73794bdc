"""Megatron-core on a machine without CUDA: the few process-local patches it needs, in one place.

Active only when `torch.cuda.is_available()` is false; on a GPU `activate_cpu_compat()` does nothing.
What megatron-core 0.16 asks of CUDA on the paths rl360 uses, and the CPU answer given here:

- `torch.cuda.current_device()` (rotary embeddings, p2p buffers, DDP grad buffers) -> "cpu";
- the model-parallel RNG tracker keeps CUDA generator states -> it keeps CPU generator states;
- `torch.cuda.synchronize` / `current_stream` / `Stream` / `stream` (p2p, DDP) -> no-ops;
- gradient clipping asserts `torch.cuda.FloatTensor` grads -> the same clipping without the assert;
- tensors created with a literal `device="cuda"` or moved with `.cuda()` (pipeline schedules)
  -> created on / kept on the CPU, by a `TorchFunctionMode` entered once for the process.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_ACTIVE = False


def activate_cpu_compat() -> bool:
    """Install the patches (idempotent). Returns True when they are active."""
    global _ACTIVE
    if torch.cuda.is_available():
        return False
    if _ACTIVE:
        return True
    _patch_cuda_module()
    _patch_megatron_rng()
    _patch_megatron_clip_grads()
    _CudaToCpu().__enter__()  # stays entered for the life of the process
    _ACTIVE = True
    return True


def _patch_cuda_module() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.device_count = lambda: 0
    cuda.synchronize = lambda *args, **kwargs: None
    cuda.current_stream = lambda *args, **kwargs: _NullStream()
    cuda.default_stream = lambda *args, **kwargs: _NullStream()
    cuda.Stream = _NullStream
    cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    # torch.manual_seed itself calls cuda.manual_seed_all: seed the CPU generator directly
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda *args, clone=False, **kwargs: (
        torch.get_rng_state().clone() if clone else torch.get_rng_state())
    mp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


def _patch_megatron_clip_grads() -> None:
    from megatron.core.optimizer import clip_grads, optimizer

    def clip_grad_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False):
        coeff = max_norm / (total_norm + 1.0e-6)
        if coeff >= 1.0:
            return
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        with torch.no_grad():
            for param in parameters:
                grad = getattr(param, attr, None)
                if grad is not None:
                    grad.mul_(coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm


class _NullStream:
    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, *args) -> None:
        pass

    def wait_event(self, *args) -> None:
        pass

    def record_event(self, *args):
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpu(TorchFunctionMode):
    """Rewrites `device="cuda"` to the CPU and makes `.cuda()` / `.to("cuda")` stay on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)
