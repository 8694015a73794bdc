"""CUDA IPC weight buckets, load format "rl360_cuda_ipc": weight sync `tensor` from a process whose weights are
on a GPU into `rl360 serve rollout` engines on that same GPU, without a copy through host memory.

Sender (`CudaIpcPacker`, driven by `rl360.weight_sync.sender.WeightSender`): a bucket's tensors are copied into
one contiguous CUDA buffer (uint8) at offsets aligned to CUDA_ALIGNMENT bytes (`rl360.weight_sync.flat_bucket`). Two
buffers alternate, so the next bucket is packed while the engines copy the one before; a buffer is packed again
only after every engine answered for it, and both are freed when the update ends. Before sending, the sender
waits for its packing to finish, then shares the buffer once per engine (`torch.UntypedStorage._share_cuda_`:
the CUDA IPC memory handle and a cross-process reference counter of torch's, one per engine), and that engine's
`/update_weights_from_tensor` gets `load_format` "rl360_cuda_ipc" with one `serialized_named_tensors` entry, the
base64 of the JSON descriptor

    {"device": {"uuid": "…", "pci_bus_id": "0000:19:00.0" or null, "name": "NVIDIA H100 80GB HBM3"},
     "ipc": {"handle": base64, "storage_bytes": int, "storage_offset": int, "ref_counter": base64,
             "ref_counter_offset": int},
     "bytes": int, "tensors": [{"name", "dtype", "shape", "offset"}, ...]}

(`device`: the GPU holding the buffer, by the UUID CUDA reports for it; `ipc`: the pieces `_share_cuda_` returns,
bytes as base64: the allocation's handle, the buffer's size and offset inside that allocation, the reference
counter's shared-memory name and slot; `bytes`: what the tensors span from the buffer's start). No pickle.

Engine (`open_bucket`): finds the GPU by its UUID among the devices it sees (CUDA_VISIBLE_DEVICES may number it
differently) and refuses unless it is the engine's own device, opens the handle
(`torch.UntypedStorage._new_shared_cuda`), copies every tensor device-to-device into tensors of its own, waits
for the copies, and drops the mapping (which releases its reference count) before answering. The sender releases
the count of an engine that answered with a refusal or could not be reached itself, so an update that fails
still frees its buffers.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from rl360.weight_sync.flat_bucket import check_specs, is_count, layout, pack, read_descriptor, unpack

CUDA_IPC_LOAD_FORMAT = "rl360_cuda_ipc"
CUDA_ALIGNMENT = 256  # byte offset of every tensor in a CUDA IPC bucket (the CUDA allocator's own alignment)
BUFFER_GRANULE = 2 << 20  # buffers are allocated in multiples of this, so buckets of similar size reuse them
DEVICE_FIELDS = frozenset({"uuid", "pci_bus_id", "name"})
IPC_FIELDS = frozenset({"handle", "storage_bytes", "storage_offset", "ref_counter", "ref_counter_offset"})
REF_COUNTERS_PER_FILE = 10000  # torch's CUDA_IPC_REF_COUNTER_FILE_SIZE: slots in one reference-counter file
MAX_HANDLE_BYTES = 4096
NO_EVENT = bytes(64)  # an empty cudaIpcEventHandle_t: the sender synchronised before sending, no event to wait on


# ---- the GPU's identity ----
def gpu_identity(index: int) -> dict:
    """`{"uuid", "pci_bus_id", "name"}` of local CUDA device `index` (pci_bus_id None where torch does not
    report it)."""
    props = torch.cuda.get_device_properties(index)
    bus = getattr(props, "pci_bus_id", None)
    pci = (f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
           if isinstance(bus, int) else None)
    return {"uuid": str(props.uuid), "pci_bus_id": pci, "name": props.name}


def local_index(uuid: str) -> int | None:
    """The index under which this process sees the GPU with `uuid`; None when it does not see it."""
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    return None


def _describe(gpu: dict) -> str:
    extra = ", ".join(str(gpu[key]) for key in ("name", "pci_bus_id") if gpu.get(key))
    return f"{gpu['uuid']} ({extra})" if extra else gpu["uuid"]


# ---- the descriptor ----
def encode_descriptor(gpu: dict, ipc: dict, size: int, specs: list[dict]) -> str:
    """The `serialized_named_tensors` entry for one engine: `ipc` holds `handle` and `ref_counter` as bytes and the
    three integers (see the module docstring)."""
    wire_ipc = {"handle": base64.b64encode(ipc["handle"]).decode("ascii"),
                "storage_bytes": ipc["storage_bytes"], "storage_offset": ipc["storage_offset"],
                "ref_counter": base64.b64encode(ipc["ref_counter"]).decode("ascii"),
                "ref_counter_offset": ipc["ref_counter_offset"]}
    descriptor = {"device": gpu, "ipc": wire_ipc, "bytes": size, "tensors": specs}
    return base64.b64encode(json.dumps(descriptor).encode()).decode("ascii")


def decode_descriptor(entry: Any) -> dict:
    """The checked descriptor of an entry, `ipc.handle` and `ipc.ref_counter` decoded to bytes; ValueError naming
    the field at fault."""
    descriptor = read_descriptor(entry, ("device", "ipc", "bytes", "tensors"))
    gpu, ipc, size = descriptor["device"], descriptor["ipc"], descriptor["bytes"]
    if not isinstance(gpu, dict) or set(gpu) != DEVICE_FIELDS:
        raise ValueError("'device' must be an object with exactly 'uuid', 'pci_bus_id' and 'name'")
    if not isinstance(gpu["uuid"], str) or not gpu["uuid"]:
        raise ValueError(f"'device.uuid' must be a non-empty string, got {gpu['uuid']!r}")
    for key in ("pci_bus_id", "name"):
        if gpu[key] is not None and not isinstance(gpu[key], str):
            raise ValueError(f"'device.{key}' must be a string or null, got {gpu[key]!r}")
    if not isinstance(ipc, dict) or set(ipc) != IPC_FIELDS:
        raise ValueError(f"'ipc' must be an object with exactly {sorted(IPC_FIELDS)}")
    for key in ("storage_bytes", "storage_offset", "ref_counter_offset"):
        if not is_count(ipc[key]):
            raise ValueError(f"'ipc.{key}' must be a non-negative integer, got {ipc[key]!r}")
    if ipc["storage_bytes"] == 0:
        raise ValueError("'ipc.storage_bytes' must be positive (an empty buffer has no handle)")
    if ipc["ref_counter_offset"] >= REF_COUNTERS_PER_FILE:
        raise ValueError(f"'ipc.ref_counter_offset' must be below {REF_COUNTERS_PER_FILE}, got "
                         f"{ipc['ref_counter_offset']}")
    handle, counter = _bytes_field(ipc, "handle"), _bytes_field(ipc, "ref_counter")
    if len(handle) > MAX_HANDLE_BYTES:
        raise ValueError(f"'ipc.handle' holds {len(handle)} bytes, more than a CUDA IPC handle ({MAX_HANDLE_BYTES})")
    name = counter.decode("ascii", errors="replace")
    if not (name.startswith("/torch_") and "/" not in name[1:] and "\0" not in name and name.isprintable()):
        raise ValueError(f"'ipc.ref_counter' must name one of torch's reference-counter files (/torch_*), got "
                         f"{name[:64]!r}")
    if not is_count(size) or size > ipc["storage_bytes"]:
        raise ValueError(f"'bytes' must be a non-negative integer within 'ipc.storage_bytes' "
                         f"({ipc['storage_bytes']}), got {size!r}")
    check_specs(descriptor["tensors"], size)
    return {**descriptor, "ipc": {**ipc, "handle": handle, "ref_counter": counter}}


def _bytes_field(ipc: dict, key: str) -> bytes:
    value = ipc[key]
    if not isinstance(value, str) or not value:
        raise ValueError(f"'ipc.{key}' must be a non-empty base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"'ipc.{key}' is not base64: {err}") from None


# ---- engine side ----
def open_bucket(entry: Any, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The `(hf_name, tensor)` pairs of an entry, copied onto `device` (the engine's), the sender's mapping closed
    again; ValueError naming what is wrong, e.g. when `device` is not the GPU the buffer is on."""
    descriptor = decode_descriptor(entry)
    gpu, ipc = descriptor["device"], descriptor["ipc"]
    needs = "the 'rl360_cuda_ipc' weight format needs the engine on the sender's GPU (or weight sync 'distributed')"
    if device.type != "cuda":
        raise ValueError(f"this engine runs on {device}, and the weights are on GPU {_describe(gpu)}: {needs}")
    index = local_index(gpu["uuid"])
    own = device.index if device.index is not None else torch.cuda.current_device()
    if index is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ValueError(f"GPU {_describe(gpu)} is not visible to this engine (CUDA_VISIBLE_DEVICES="
                         f"{'unset' if visible is None else repr(visible)}; it runs on cuda:{own}, "
                         f"{_describe(gpu_identity(own))}): {needs}")
    if index != own:
        raise ValueError(f"the weights are on cuda:{index} of this engine ({_describe(gpu)}), and the engine runs on "
                         f"cuda:{own}: {needs}")
    storage = flat = None
    named, failure = [], None
    try:
        with torch.cuda.device(index):
            try:
                storage = torch.UntypedStorage._new_shared_cuda(
                    index, ipc["handle"], ipc["storage_bytes"], ipc["storage_offset"], ipc["ref_counter"],
                    ipc["ref_counter_offset"], NO_EVENT, False)
            except RuntimeError as err:
                failure = (f"cannot open the CUDA IPC handle on cuda:{index} ({err}): the sender's buffer is gone, or "
                           "not the sender's to share")
            if storage is not None:
                flat = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
                flat.set_(storage, 0, (descriptor["bytes"],), (1,))
                try:
                    named = unpack(flat, descriptor["tensors"])
                    torch.cuda.current_stream(index).synchronize()  # copied before the sender hears back
                except RuntimeError as err:  # out of memory, a CUDA error
                    failure = f"copying the bucket out of the sender's buffer failed: {err}"
    finally:
        flat = storage = None  # the mapping closes here, which releases this engine's reference count
    if failure is not None:  # raised here, so no traceback holds a view into the mapping
        raise ValueError(failure)
    return named


# ---- sender side ----
@dataclass
class PackedBucket:
    buffer: torch.Tensor  # uint8, on the GPU the bucket is shared from
    specs: list[dict]
    size: int


class CudaIpcPacker:
    """The sender's two alternating CUDA buffers (see the module docstring). One packer serves one update; `close`
    frees its buffers."""

    def __init__(self):
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        self._gpus: dict[int, dict] = {}

    def pack(self, bucket: list[tuple[str, torch.Tensor]]) -> PackedBucket:
        """Copy `bucket` into the buffer whose turn it is (its previous bucket must have been answered by every
        engine); the copies are queued on the GPU's current stream. The buffer is on the GPU of the bucket's first
        CUDA tensor; tensors elsewhere are copied there."""
        device = next(tensor.device for _, tensor in bucket if tensor.is_cuda)
        specs, size = layout(bucket, CUDA_ALIGNMENT)
        slot, self._turn = self._turn, 1 - self._turn
        buffer = self._buffers[slot]
        if buffer is None or buffer.device != device or buffer.numel() < size:
            self._buffers[slot] = buffer = None  # the old one is freed before a larger one is taken
            capacity = max(-(-size // BUFFER_GRANULE) * BUFFER_GRANULE, BUFFER_GRANULE)
            buffer = self._buffers[slot] = torch.empty(capacity, dtype=torch.uint8, device=device)
        with torch.cuda.device(device):
            pack(bucket, specs, buffer)
        return PackedBucket(buffer, specs, size)

    def share(self, packed: PackedBucket) -> tuple[str, tuple[bytes, int]]:
        """One engine's entry for `packed` and the reference counter it holds (see `release`). Waits for the
        packing to finish first."""
        device = packed.buffer.device
        with torch.cuda.device(device):
            torch.cuda.current_stream(device).synchronize()
            (_, handle, storage_bytes, storage_offset, ref_counter, ref_counter_offset,
             _, _) = packed.buffer.untyped_storage()._share_cuda_()
        if device.index not in self._gpus:
            self._gpus[device.index] = gpu_identity(device.index)
        ipc = {"handle": handle, "storage_bytes": storage_bytes, "storage_offset": storage_offset,
               "ref_counter": ref_counter, "ref_counter_offset": ref_counter_offset}
        entry = encode_descriptor(self._gpus[device.index], ipc, packed.size, packed.specs)
        return entry, (ref_counter, ref_counter_offset)

    @staticmethod
    def release(counter: tuple[bytes, int]) -> None:
        """Release an engine's reference count that it will not release itself (it refused before opening the
        handle, or was never reached); releasing one it did release too is harmless."""
        torch.UntypedStorage._release_ipc_counter_cuda(*counter)

    def close(self) -> None:
        """Free both buffers (and any block torch kept for a consumer that has since let go)."""
        self._buffers = [None, None]
        torch.cuda.ipc_collect()
