"""`actor.offload`: the policy's state in host memory while the phase at hand does not use it.

A rank's state falls in four groups: `weights` (the model's parameters), `grads` (megatron's gradient
buffers), `optimizer` (Adam's moments and the fp32 main weights of bf16 parameters) and `reference` (the
reference model's weights). Offloading a group copies each of its storages to a host buffer (pinned on a GPU,
allocated once and reused) and frees the storage (`resize_(0)`): every tensor object and view - a DDP
`main_grad`, an optimizer's reference to its parameter - stays valid and sees its values again once the
storage is reloaded. Gradients are not copied: they are zeroed on reload, as every update starts by zeroing
them. Storages shared between groups (fp32 parameters are their own main weights) belong to the first group
that names them, in the order above.

`PolicyWorker` keeps resident only what a call needs (`StateOffload.using`): log-probs need the weights,
reference log-probs the reference weights, an update the weights and gradients, and the optimizer state only for
each optimizer step (`StateOffload.only_during`: the forward and backward passes, whose activations are the
update's largest memory, run without it), weight export and checkpoints the weights (and the optimizer).
Between calls the weights stay on the GPU, unless the engines are colocated (`rollout.colocate`), whose memory
they then give to the engines while those generate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch

GROUPS = ("weights", "grads", "optimizer", "reference")


class StateOffload:
    """Offload and reload named groups of tensors; each group's tensors are listed by a function, called anew
    each time (an optimizer creates its state at its first step)."""

    def __init__(self, groups: dict[str, Callable[[], Iterable[torch.Tensor]]], keep_values: dict[str, bool],
                 resident_between_calls: Iterable[str] = ()):
        self.groups = {name: groups[name] for name in GROUPS if name in groups}
        self.keep_values = keep_values
        self.resident_between_calls = set(resident_between_calls)
        # per offloaded group: (storage, its size in bytes, its host copy or None)
        self.offloaded: dict[str, list[tuple[torch.UntypedStorage, int, torch.Tensor | None]]] = {}
        self._host: dict[tuple[str, int, int], torch.Tensor] = {}  # reused from one offload to the next
        self._depth = 0  # calls in progress (`using` nests: an update exports, an export gathers)

    def _storages(self, name: str) -> list[torch.UntypedStorage]:
        """The distinct non-empty storages of group `name` that no earlier group holds."""
        taken: set[int] = set()
        for earlier in self.groups:
            if earlier == name:
                break
            taken |= {tensor.untyped_storage().data_ptr() for tensor in self.groups[earlier]()}
        found: dict[int, torch.UntypedStorage] = {}
        for tensor in self.groups[name]():
            storage = tensor.untyped_storage()
            if storage.size() and storage.data_ptr() not in taken:
                found.setdefault(storage.data_ptr(), storage)
        return list(found.values())

    def offload(self, name: str) -> None:
        if name in self.offloaded or name not in self.groups:
            return
        saved = []
        for index, storage in enumerate(self._storages(name)):
            host = None
            if self.keep_values[name]:
                key = (name, index, storage.size())
                host = self._host.get(key)
                if host is None:
                    host = self._host[key] = torch.empty(storage.size(), dtype=torch.uint8,
                                                         pin_memory=storage.device.type == "cuda")
                host.copy_(_bytes(storage), non_blocking=True)
            saved.append((storage, storage.size(), host))
        on_gpu = bool(saved) and saved[0][0].device.type == "cuda"
        if on_gpu:
            torch.cuda.synchronize()  # the copies are done before the memory is handed back
        for storage, _, _ in saved:
            storage.resize_(0)
        self.offloaded[name] = saved
        if on_gpu:
            torch.cuda.empty_cache()

    def reload(self, name: str) -> None:
        for storage, size, host in self.offloaded.pop(name, []):
            storage.resize_(size)
            if host is not None:
                _bytes(storage).copy_(host, non_blocking=True)
            else:
                _bytes(storage).zero_()

    @contextlib.contextmanager
    def using(self, *names: str) -> Iterator[None]:
        """`names` resident for the body; when the outermost call ends, every group not kept between calls goes
        to the host."""
        if self._depth == 0:
            for name in self.groups:
                if name not in names and name not in self.resident_between_calls:
                    self.offload(name)
        for name in names:
            self.reload(name)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.park()

    @contextlib.contextmanager
    def only_during(self, *names: str) -> Iterator[None]:
        """Inside a call: `names` resident for the body alone, back to the host at its end (those that were
        offloaded when it began)."""
        loaded = [name for name in names if name in self.offloaded]
        for name in loaded:
            self.reload(name)
        try:
            yield
        finally:
            for name in loaded:
                self.offload(name)

    def park(self) -> None:
        """Every group not kept between calls to the host."""
        for name in self.groups:
            if name not in self.resident_between_calls:
                self.offload(name)

    def resident_bytes(self) -> dict[str, int]:
        """Bytes each group holds on its device now (0 while offloaded)."""
        return {name: sum(storage.size() for storage in self._storages(name)) for name in self.groups}

    def total_bytes(self) -> dict[str, int]:
        """Bytes of each group wherever they are now (on the device, or on the host while offloaded)."""
        return {name: resident + sum(size for _, size, _ in self.offloaded.get(name, []))
                for name, resident in self.resident_bytes().items()}


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
