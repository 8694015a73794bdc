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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_bridge.arch.base import fuse_gate_up, fuse_qkv, split_gate_up
from megatron_bridge.safetensors_io import SafetensorsReader

VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class TPSlice:
    """Where one megatron parameter of this rank sits in the full tensor."""

    dim: int | None  # partition dimension, None when every rank holds all of it
    rank: int
    size: int
    padded_rows: int | None = None  # the padded vocabulary, for embedding / output layer

    @classmethod
    def of(cls, name: str, param: torch.Tensor, rank: int, size: int) -> TPSlice:
        split = bool(getattr(param, "tensor_model_parallel", False)) and size > 1
        padded = param.shape[0] * (size if split else 1) if name in VOCAB_PARAMS else None
        return cls(getattr(param, "partition_dim", 0) if split else None, rank, size, padded)

    def bounds(self, full: int) -> tuple[int, int]:
        """[start, stop) of this rank's part of a dimension of size `full` (before padding)."""
        if self.dim is None:
            return 0, full
        per = full // self.size
        return self.rank * per, (self.rank + 1) * per


def load_slice(reader: SafetensorsReader, hf_names: tuple[str, ...], layout: str, where: TPSlice,
               num_query_groups: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's part of the megatron tensor fused from `hf_names`, reading only that part from disk
    (for a plain row, straight into `out` when it can take the bytes as they are; see `read`)."""
    if layout == "qkv":
        q, k, v = (_read_part(reader, name, where) for name in hf_names)
        return fuse_qkv(q, k, v, num_query_groups=num_query_groups // (where.size if where.dim is not None else 1))
    if layout == "gate_up":
        gate, up = (_read_part(reader, name, where) for name in hf_names)
        return fuse_gate_up(gate, up)
    if layout != "same":
        raise ValueError(f"unknown layout {layout!r}")
    if where.padded_rows is None:
        return _read_part(reader, hf_names[0], where, out)
    return _read_vocab_part(reader, hf_names[0], where)


def gather_full(local: torch.Tensor, layout: str, where: TPSlice) -> torch.Tensor:
    """The full megatron tensor from every tensor-parallel rank's `local` part (a collective over the
    TP group when the parameter is split), without vocabulary padding."""
    if where.dim is None:
        full = local
    else:
        from megatron.core import parallel_state

        parts = [torch.empty_like(local) for _ in range(where.size)]
        dist.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        if layout == "gate_up":
            gates, ups = zip(*(split_gate_up(part) for part in parts))
            full = fuse_gate_up(torch.cat(gates), torch.cat(ups))
        else:
            full = torch.cat(parts, dim=where.dim)
    return full


def _read_part(reader: SafetensorsReader, name: str, where: TPSlice, out: torch.Tensor | None = None) -> torch.Tensor:
    if where.dim is None:
        return reader.read(name, out=out)
    full = reader.info(name).shape[where.dim]
    if full % where.size:
        raise ValueError(f"{name}: dimension {where.dim} of size {full} does not split over TP={where.size}")
    start, stop = where.bounds(full)
    return reader.read(name, where.dim, start, stop, out=out)


def _read_vocab_part(reader: SafetensorsReader, name: str, where: TPSlice) -> torch.Tensor:
    """Rows [start, stop) of the padded vocabulary: real rows from disk, zeros past the real vocabulary."""
    info = reader.info(name)
    vocab = info.shape[0]
    start, stop = (0, where.padded_rows) if where.dim is None else where.bounds(where.padded_rows)
    real = reader.read(name, 0, min(start, vocab), min(stop, vocab))
    if real.shape[0] == stop - start:
        return real
    padding = torch.zeros((stop - start - real.shape[0], *info.shape[1:]), dtype=info.dtype)
    return torch.cat([real, padding])
