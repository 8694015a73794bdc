"""Megatron-core on a machine without CUDA: the few process-local patches it needs, in one place.

Active only when `torch.cuda.is_available()` is false; on a GPU `activate_cpu_compat()` does nothing.
What megatron-core 0.16 asks of CUDA on the paths rl360 uses, and the CPU answer given here:

- `torch.cuda.current_device()` (DDP grad buffers, rotary embeddings, p2p buffers) -> "cpu";
- the model-parallel RNG tracker keeps CUDA generator states (`torch.cuda.get_rng_state`, megatron's
  `_get/_set_cuda_rng_state`) -> it keeps CPU generator states. `torch.cuda.manual_seed` seeds the CPU
  generator, so each tracker state is really seeded; note that `model_parallel_cuda_manual_seed(seed)`
  therefore also reseeds the process's default CPU generator;
- `torch.cuda.synchronize` (pipeline p2p) and the stream API (`current_stream`, `default_stream`,
  `Stream`, `stream`: DDP with overlapped reduction; a stream's recorded event: the MoE all-to-all
  dispatcher's device-to-host copies) -> no-ops;
- gradient clipping asserts `torch.cuda.FloatTensor` grads -> the same clipping without the assert;
- tensors created with a literal `device="cuda"` or moved with `.cuda()` / `.to("cuda")` (pipeline
  schedules, the optimizer's loss scale) -> created on / kept on the CPU, by a `TorchFunctionMode`; the same
  mode drops `pin_memory=True` (context parallelism's RoPE stages its chunk indices in pinned memory);
- the mixed-precision and distributed optimizers sort parameters by `param.type()` and accept only CUDA type
  names ("torch.cuda.BFloat16Tensor", ...) -> the same mode answers `Tensor.type()` (no arguments) with the
  CUDA name of a CPU tensor's type, so bf16 parameters get their fp32 main copies as on a GPU;
- without Apex or Transformer Engine megatron's optimizers are torch's Adam, whose state holds a per-parameter
  `step`; the distributed optimizer's fully reshardable checkpoint loader copies every state key from the
  checkpoint, which carries the step once, in its param groups (restored from there, as one tensor shared by
  every parameter: torch's Adam increments each parameter's step in place) -> the loader gives each parameter
  its own copy of the restored step and leaves it as it is;
- the MoE all-to-all dispatcher turns its split sizes into numpy arrays (`maybe_move_tensor_to_cpu(...,
  as_numpy=True)`) only when they are on a GPU, and gloo's `all_to_all_single` refuses tensors as split
  sizes -> the CPU tensors become numpy arrays there too;
- activation recomputation re-runs layers (`device="cuda"` masks included) during the backward pass, where
  the mode is off (megatron starts it through a call the mode handles) -> the recomputing backward enters it;
- pipeline p2p: megatron posts a stage's sends to its previous and next stage (and, with variable shapes, the
  shapes first, always this way) as one `batch_isend_irecv`, all on one tag. NCCL pairs them by direction; gloo
  pairs them by order alone, and at PP=2 the previous and next stage are the same rank, so under the
  interleaved (virtual pipeline) schedule an activation and a gradient crossing at once are received in each
  other's place -> `torch.distributed.ring_exchange`, megatron's hook for a custom exchange (used when a
  model's config sets `use_ring_exchange_p2p`, as the CPU policy's does), defined here with a tag per direction.

The mode is entered once and never exited, rather than wrapped around each megatron call, so every
code path (schedules, optimizer, checkpointing) is covered without callers having to know. PyTorch keeps
the mode stack per thread: the first call enters it for the calling thread, and a later call from
another thread enters it there too (the rest of the patches are installed once per process).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

_PATCHED = False
_THREAD = threading.local()


def activate_cpu_compat() -> None:
    """Make megatron-core run on the CPU in this process (and this thread). Idempotent; no-op with CUDA."""
    global _PATCHED
    if torch.cuda.is_available():
        return
    if not _PATCHED:
        _patch_cuda_module()
        _patch_megatron_rng()
        _patch_megatron_clip_grads()
        _patch_megatron_recompute()
        _patch_megatron_distributed_optimizer_step()
        _patch_megatron_moe_splits()
        torch.distributed.ring_exchange = ring_exchange
        _PATCHED = True
    if not getattr(_THREAD, "mode_entered", False):
        _CudaToCpu().__enter__()  # stays entered for the life of the thread
        _THREAD.mode_entered = True


def _patch_cuda_module() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda *args, **kwargs: None
    cuda.current_stream = lambda *args, **kwargs: _NullStream()
    cuda.default_stream = lambda *args, **kwargs: _NullStream()
    cuda.Stream = _NullStream
    cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))


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


def _patch_megatron_recompute() -> None:
    """Activation recomputation re-runs layers inside the backward pass, which megatron's schedule starts
    through `torch.autograd.backward`: a call the mode handles, with the mode off while it runs. The
    recomputing backward enters the mode again."""
    from megatron.core.tensor_parallel import random as mp_random

    original = mp_random.CheckpointFunction.backward

    def backward(ctx, *args):
        with _CudaToCpu():
            return original(ctx, *args)

    mp_random.CheckpointFunction.backward = staticmethod(backward)


def _patch_megatron_distributed_optimizer_step() -> None:
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:  # FusedAdam keeps no per-parameter step
        return
    original = distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
            state["step"] = state["step"].clone()  # restored as one tensor shared by every parameter, which torch's
            tensors = dict(tensors, step=state["step"])  # Adam would increment once per parameter; copied onto itself
        return original(self, model_param, tensors)

    distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def _patch_megatron_moe_splits() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:  # already on the CPU: only the numpy
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu


# p2p tags of the two directions: activations travel to the next stage, gradients to the previous one
FORWARD_TAG, BACKWARD_TAG = 1, 2


def ring_exchange(*, tensor_send_prev=None, tensor_recv_prev=None, tensor_send_next=None, tensor_recv_next=None,
                  group=None, prev_pipeline_rank: int | None = None, next_pipeline_rank: int | None = None) -> None:
    """Send to / receive from the previous and next pipeline stage (global ranks; by default the neighbours in
    `group`, wrapping around) and wait: what a stage sends to its next stage arrives in that stage's
    `tensor_recv_prev`, whatever else crosses between the two ranks at the same time."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    prev = ranks[(me - 1) % len(ranks)] if prev_pipeline_rank is None else prev_pipeline_rank
    nxt = ranks[(me + 1) % len(ranks)] if next_pipeline_rank is None else next_pipeline_rank
    requests = []
    for tensor, peer, tag, send in ((tensor_send_next, nxt, FORWARD_TAG, True),
                                    (tensor_recv_prev, prev, FORWARD_TAG, False),
                                    (tensor_send_prev, prev, BACKWARD_TAG, True),
                                    (tensor_recv_next, nxt, BACKWARD_TAG, False)):
        if tensor is not None:
            requests.append((dist.isend if send else dist.irecv)(tensor, peer, group=group, tag=tag))
    for request in requests:
        request.wait()


class _NullStream:
    """Stands in for `torch.cuda.Stream`: every operation is immediate on the CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, *args) -> None:
        pass

    def wait_event(self, *args) -> None:
        pass

    def record_event(self, *args):
        return _NullEvent()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class _NullEvent:
    """Stands in for `torch.cuda.Event` (the MoE all-to-all dispatcher waits on one): always complete."""

    def synchronize(self) -> None:
        pass

    def wait(self, *args) -> None:
        pass

    def query(self) -> bool:
        return True


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
        if kwargs.get("pin_memory"):  # staging for a host-to-GPU copy that stays on the host here
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # the type's name, as megatron reads it
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)
