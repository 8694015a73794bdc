"""Tensor-parallel slices: which part of the HF tensors a rank loads, and how the full tensor is rebuilt.

Megatron marks each tensor-parallel parameter with `tensor_model_parallel=True` and the `partition_dim`
it is split along (0 for column-parallel linears and the vocab-parallel embedding / output layer, 1 for
row-parallel linears). For the fused layouts the split is not a plain slice of the fused tensor:
- "qkv": rank r holds query groups [r*G/tp, (r+1)*G/tp), each group's q heads then k then v;
  because the fused layout is group-major, concatenating the ranks' slices gives the full tensor;
- "gate_up": rank r holds its slice of gate stacked on its slice of up, so the full tensor is rebuilt
  by splitting every rank's slice into gate and up first.
Vocabulary rows are padded (see `config_map.padded_vocab_size`): the padding rows are zeros when
loading and dropped when gathering.

Expert parallelism (a mixture-of-experts model): EP rank r holds routed experts [r*E/ep, (r+1)*E/ep) as
`local_experts.0 ...`; `ExpertShard` maps those names to the tables' global expert index and says which EP
rank holds an expert. An expert's linears are split over the expert-tensor-parallel group (megatron's
default: the same size as TP), the rest of the layer over TP as usual.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_bridge.arch.base import fuse_gate_up, split_gate_up
from megatron_bridge.safetensors_io import SafetensorsReader

VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")
_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def expert_index(name: str) -> int | None:
    """The expert index in a routed expert's megatron parameter name, None for any other parameter."""
    match = _EXPERT.match(name)
    return int(match.group(2)) if match else None


@dataclass(frozen=True)
class ExpertShard:
    """Which routed experts this rank holds: an equal, contiguous share of `num_experts` per EP rank."""

    rank: int
    size: int
    num_experts: int

    @classmethod
    def current(cls, num_experts: int) -> ExpertShard:
        from megatron.core import parallel_state

        if not num_experts:
            return cls(0, 1, 0)
        return cls(parallel_state.get_expert_model_parallel_rank(),
                   parallel_state.get_expert_model_parallel_world_size(), num_experts)

    @property
    def local(self) -> int:
        return self.num_experts // self.size

    def owner(self, expert: int) -> int:
        """The EP rank holding `expert`."""
        return expert // self.local

    def holds(self, name: str) -> bool:
        """Whether this rank has the parameter `name` (global expert index): every non-expert one does."""
        expert = expert_index(name)
        return expert is None or self.owner(expert) == self.rank

    def global_name(self, name: str) -> str:
        """A parameter name of this rank's model with its local expert index made global."""
        match = _EXPERT.match(name)
        if not match:
            return name
        return f"{match.group(1)}{self.rank * self.local + int(match.group(2))}{match.group(3)}"


@dataclass(frozen=True)
class TPSlice:
    """Where one megatron parameter of this rank sits in the full tensor."""

    dim: int | None  # partition dimension, None when every rank holds all of it
    rank: int
    size: int
    padded_rows: int | None = None  # the padded vocabulary, for embedding / output layer
    expert: bool = False  # a routed expert's: split over the expert-tensor-parallel group

    @classmethod
    def of(cls, name: str, param: torch.Tensor, rank: int, size: int, expert: bool = False) -> TPSlice:
        split = bool(getattr(param, "tensor_model_parallel", False)) and size > 1
        padded = param.shape[0] * (size if split else 1) if name in VOCAB_PARAMS else None
        return cls(getattr(param, "partition_dim", 0) if split else None, rank, size, padded, expert)

    @classmethod
    def current(cls, name: str, param: torch.Tensor) -> TPSlice:
        """The slice of `param` (megatron name `name`) this rank holds, from megatron's parallel state."""
        from megatron.core import parallel_state as ps

        if expert_index(name) is not None:
            return cls.of(name, param, ps.get_expert_tensor_parallel_rank(),
                          ps.get_expert_tensor_parallel_world_size(), expert=True)
        return cls.of(name, param, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())

    def group(self):
        """The process group this parameter is split over."""
        from megatron.core import parallel_state

        return (parallel_state.get_expert_tensor_parallel_group() if self.expert
                else parallel_state.get_tensor_model_parallel_group())

    def bounds(self, full: int) -> tuple[int, int]:
        """[start, stop) of this rank's part of a dimension of size `full` (before padding)."""
        if self.dim is None:
            return 0, full
        per = full // self.size
        return self.rank * per, (self.rank + 1) * per


def load_into(reader: SafetensorsReader, hf_names: tuple[str, ...], layout: str, where: TPSlice,
              num_query_groups: int, target: torch.Tensor) -> None:
    """Fill `target`, this rank's part of the megatron tensor fused from `hf_names`, reading only that part
    from disk, each piece straight into its place in `target` (no fused copy is built on the side)."""
    placements = _placements(reader, hf_names, layout, where, num_query_groups, target)
    for name, dim, start, stop, dest in placements:
        reader.read_into(name, dest, dim, start, stop)
    if where.padded_rows is not None:  # the vocabulary's padding rows, past the real ones: zeros
        with torch.no_grad():
            target[placements[0][4].shape[0]:].zero_()


Placement = tuple[str, int, int, int, torch.Tensor]  # (HF name, dim, start, stop, destination)


def _placements(reader: SafetensorsReader, hf_names: tuple[str, ...], layout: str, where: TPSlice,
                num_query_groups: int, target: torch.Tensor) -> list[Placement]:
    """Which range of which HF tensor goes into which part of `target`."""
    if layout == "qkv":
        return _qkv_placements(reader, hf_names, where, num_query_groups, target)
    if layout == "gate_up":
        start, stop = _bounds(reader, hf_names[0], 0, where)
        rows = stop - start
        _expect_rows(target, 2 * rows, hf_names, where)
        return [(hf_names[0], 0, start, stop, target[:rows]), (hf_names[1], 0, start, stop, target[rows:])]
    if layout != "same":
        raise ValueError(f"unknown layout {layout!r}")
    name = hf_names[0]
    if where.padded_rows is not None:  # the vocabulary: this rank's rows of the padded table that exist on disk
        start, stop = where.bounds(where.padded_rows)
        vocab = reader.info(name).shape[0]
        _expect_rows(target, stop - start, hf_names, where)
        real_start, real_stop = min(start, vocab), min(stop, vocab)
        return [(name, 0, real_start, real_stop, target[:real_stop - real_start])]
    dim = 0 if where.dim is None else where.dim
    return [(name, dim, *_bounds(reader, name, dim, where), target)]


def _qkv_placements(reader: SafetensorsReader, hf_names: tuple[str, ...], where: TPSlice, num_query_groups: int,
                    target: torch.Tensor) -> list[Placement]:
    """Megatron's fused q/k/v is group-major: this rank's query groups, each its query heads' rows, then its
    key rows, then its value rows (the "qkv" layout of `arch.base`)."""
    q, k, v = hf_names
    q_rows, kv_rows = reader.info(q).shape[0], reader.info(k).shape[0]
    if reader.info(v).shape[0] != kv_rows or q_rows % num_query_groups or kv_rows % num_query_groups:
        raise ValueError(f"{hf_names}: rows {q_rows}/{kv_rows}/{reader.info(v).shape[0]} do not split into "
                         f"{num_query_groups} query groups")
    split = where.dim is not None
    if split and num_query_groups % where.size:
        raise ValueError(f"{hf_names}: {num_query_groups} query groups do not split over TP={where.size}")
    local = num_query_groups // where.size if split else num_query_groups
    first = where.rank * local if split else 0
    per_q, per_kv = q_rows // num_query_groups, kv_rows // num_query_groups
    _expect_rows(target, local * (per_q + 2 * per_kv), hf_names, where)
    grouped = target.view(local, per_q + 2 * per_kv, *target.shape[1:])
    placements = []
    for j in range(local):
        group = first + j
        placements += [(q, 0, group * per_q, (group + 1) * per_q, grouped[j, :per_q]),
                       (k, 0, group * per_kv, (group + 1) * per_kv, grouped[j, per_q:per_q + per_kv]),
                       (v, 0, group * per_kv, (group + 1) * per_kv, grouped[j, per_q + per_kv:])]
    return placements


def _bounds(reader: SafetensorsReader, name: str, dim: int, where: TPSlice) -> tuple[int, int]:
    """This rank's [start, stop) of `name` along `dim` (all of it when the parameter is not split)."""
    full = reader.info(name).shape[dim]
    if where.dim is not None and full % where.size:
        raise ValueError(f"{name}: dimension {dim} of size {full} does not split over TP={where.size}")
    return where.bounds(full)


def _expect_rows(target: torch.Tensor, rows: int, hf_names: tuple[str, ...], where: TPSlice) -> None:
    if target.shape[0] != rows:
        raise ValueError(f"{hf_names}: this rank's part has {rows} rows, the megatron parameter "
                         f"{tuple(target.shape)} (TP rank {where.rank} of {where.size})")


def gather_full(local: torch.Tensor, layout: str, where: TPSlice) -> torch.Tensor:
    """The full megatron tensor from every tensor-parallel rank's `local` part (a collective over the
    TP group when the parameter is split), without vocabulary padding."""
    if where.dim is None:
        full = local
    else:
        parts = [torch.empty_like(local) for _ in range(where.size)]
        dist.all_gather(parts, local.contiguous(), group=where.group())
        if layout == "gate_up":
            gates, ups = zip(*(split_gate_up(part) for part in parts))
            full = fuse_gate_up(torch.cat(gates), torch.cat(ups))
        else:
            full = torch.cat(parts, dim=where.dim)
    return full
