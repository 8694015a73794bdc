"""A bucket of weights as one flat byte buffer, the layout the shared-memory and CUDA IPC weight formats share:
each tensor at an aligned byte offset, described by `{"name", "dtype", "shape", "offset"}` (dtype as SGLang
spells it: "float32", "bfloat16", ...). Packing into and copying out of a flat uint8 tensor work on any device.

    specs, size = layout(bucket, alignment=256)    # bucket: [(hf_name, tensor), ...]
    flat = torch.empty(size, dtype=torch.uint8, device=...)
    pack(bucket, specs, flat)
    check_specs(specs, size)                       # what a reader checks before trusting a descriptor
    named = unpack(flat, specs)                    # [(hf_name, tensor)], copies that own their memory
    descriptor = read_descriptor(entry, ("path", "bytes", "tensors"))   # a request's base64 JSON descriptor
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import torch

from rl360.core.wire import check_unique

WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "float64": torch.float64}  # names as SGLang's engine reads them: getattr(torch, name)
SPEC_FIELDS = frozenset({"name", "dtype", "shape", "offset"})


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's spelling of a weight dtype ("float32", "bfloat16", ...); ValueError for other dtypes."""
    name = str(dtype).removeprefix("torch.")
    if WEIGHT_DTYPES.get(name) is not dtype:
        raise ValueError(f"weights must be one of {sorted(WEIGHT_DTYPES)}, got {dtype}")
    return name


def is_count(value: Any) -> bool:
    """A non-negative int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def spec_bytes(spec: dict) -> int:
    """The bytes of the tensor a (checked) spec describes."""
    count = 1
    for extent in spec["shape"]:
        count *= extent
    return count * WEIGHT_DTYPES[spec["dtype"]].itemsize


def layout(named_tensors: list[tuple[str, torch.Tensor]], alignment: int) -> tuple[list[dict], int]:
    """Each tensor's spec at the next multiple of `alignment`, and the bytes the whole bucket spans."""
    check_unique([name for name, _ in named_tensors])
    specs, offset = [], 0
    for name, tensor in named_tensors:
        offset += -offset % alignment
        specs.append({"name": name, "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape),
                      "offset": offset})
        offset += tensor.numel() * tensor.element_size()
    return specs, offset


def pack(named_tensors: list[tuple[str, torch.Tensor]], specs: list[dict], flat: torch.Tensor) -> None:
    """Copy each tensor to its spec's offset of the uint8 tensor `flat` (any device; views and non-contiguous
    tensors are copied as their values)."""
    for (_, tensor), spec in zip(named_tensors, specs):
        size = tensor.numel() * tensor.element_size()
        if size:
            start = spec["offset"]
            flat[start:start + size].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())


def unpack(flat: torch.Tensor, specs: list[dict]) -> list[tuple[str, torch.Tensor]]:
    """The tensors `specs` (checked against `flat`'s length) describe, each copied out of the uint8 tensor `flat`
    on its device."""
    named = []
    for spec in specs:
        start = spec["offset"]
        piece = flat[start:start + spec_bytes(spec)]
        named.append((spec["name"], piece.view(WEIGHT_DTYPES[spec["dtype"]]).reshape(spec["shape"]).clone()))
    return named


def check_specs(tensors: Any, size: int, where: str = "tensors") -> None:
    """ValueError naming the entry at fault unless `tensors` is a non-empty list of specs with unique names,
    known dtypes, non-negative shapes and offsets that are multiples of the element size with the tensor inside
    `size` bytes."""
    if not isinstance(tensors, list) or not tensors:
        raise ValueError(f"'{where}' must be a non-empty list")
    for index, spec in enumerate(tensors):
        at = f"{where}[{index}]"
        if not isinstance(spec, dict) or set(spec) != SPEC_FIELDS:
            raise ValueError(f"{at} must be an object with exactly 'name', 'dtype', 'shape' and 'offset'")
        if not isinstance(spec["name"], str) or not spec["name"]:
            raise ValueError(f"{at}.name must be a non-empty string")
        if spec["dtype"] not in WEIGHT_DTYPES:
            raise ValueError(f"{at}.dtype must be one of {sorted(WEIGHT_DTYPES)}, got {spec['dtype']!r}")
        if not isinstance(spec["shape"], list) or not all(is_count(s) for s in spec["shape"]):
            raise ValueError(f"{at}.shape must be a list of non-negative integers")
        itemsize = WEIGHT_DTYPES[spec["dtype"]].itemsize
        if not is_count(spec["offset"]) or spec["offset"] % itemsize or spec["offset"] + spec_bytes(spec) > size:
            raise ValueError(f"{at}.offset must be a multiple of {itemsize} with the tensor inside the "
                             f"{size} bytes, got {spec['offset']!r}")
    check_unique([spec["name"] for spec in tensors])


def read_descriptor(entry: Any, fields: tuple[str, ...]) -> dict:
    """The JSON object a request entry (base64 of it) holds, with exactly `fields`; ValueError saying what is
    wrong."""
    if not isinstance(entry, str):
        raise ValueError("entries must be base64 strings")
    try:
        descriptor = json.loads(base64.b64decode(entry, validate=True))
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"not base64 of a JSON descriptor: {err}") from None
    if not isinstance(descriptor, dict) or set(descriptor) != set(fields):
        names = ", ".join(f"'{field}'" for field in fields[:-1]) + f" and '{fields[-1]}'"
        raise ValueError(f"the descriptor must be an object with exactly {names}")
    return descriptor
