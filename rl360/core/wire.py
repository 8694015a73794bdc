"""The "rl360_safetensors" weight bucket: a bucket of `(hf_name, tensor)` as the base64 of one safetensors file,
one `serialized_named_tensors` entry of SGLang's `/update_weights_from_tensor`. `EngineClient` sends it,
`rl360 serve rollout` reads it; the other formats (shared memory, CUDA IPC, disk) live in `rl360.weight_sync`."""

from __future__ import annotations

import base64
import binascii
from typing import Any

import torch

WeightBucket = list[tuple[str, torch.Tensor]]
TENSOR_LOAD_FORMAT = "rl360_safetensors"  # base64 of a safetensors file (EngineClient.update_weights_from_tensor)


def check_unique(names: list[str]) -> None:
    if len(set(names)) != len(names):
        raise ValueError(f"a bucket names a weight twice: {sorted({n for n in names if names.count(n) > 1})[:8]}")


def encode_tensor_bucket(named_tensors: WeightBucket) -> str:
    """A bucket of `(hf_name, tensor)` as a `serialized_named_tensors` entry in TENSOR_LOAD_FORMAT."""
    from safetensors.torch import save

    check_unique([name for name, _ in named_tensors])
    return base64.b64encode(save(owning_copies(named_tensors))).decode("ascii")


def decode_tensor_bucket(entry: Any) -> WeightBucket:
    """The pairs of one TENSOR_LOAD_FORMAT entry; ValueError saying what is malformed."""
    from safetensors.torch import load

    if not isinstance(entry, str):
        raise ValueError("entries must be base64 strings")
    try:
        return list(load(base64.b64decode(entry, validate=True)).items())
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"not base64 of a safetensors file: {err}") from None
    except Exception as err:  # safetensors raises its own error type for a malformed header
        raise ValueError(f"not a safetensors file: {err}") from None


def owning_copies(named_tensors: WeightBucket) -> dict[str, torch.Tensor]:
    """CPU tensors that each own their whole storage, as safetensors requires: a view into a larger tensor (a
    slice of a fused weight) or a tensor sent under two names (tied weights) is copied."""
    seen: set[int] = set()
    owned = {}
    for name, tensor in named_tensors:
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage()
        if storage.nbytes() != tensor.numel() * tensor.element_size() or storage.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        owned[name] = tensor
    return owned
