"""What an architecture file declares, and the q/k/v and gate/up layouts shared by all of them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

Row = tuple[str, str | tuple[str, ...], str]  # (megatron name, HF name or names, layout)


@dataclass(frozen=True)
class Architecture:
    name: str
    hf_architectures: tuple[str, ...]
    global_weights: list[Row]
    layer_weights: list[Row]
    qkv_bias: bool = False
    qk_layernorm: bool = False

    def rows(self, num_layers: int, tied_embeddings: bool) -> list[tuple[str, tuple[str, ...], str]]:
        """Every (megatron name, HF names, layout) of a model with `num_layers` layers."""
        out = []
        for mcore, hf, layout in self.global_weights:
            if tied_embeddings and mcore == "output_layer.weight":
                continue
            out.append((mcore, hf if isinstance(hf, tuple) else (hf,), layout))
        for i in range(num_layers):
            for mcore, hf, layout in self.layer_weights:
                names = hf if isinstance(hf, tuple) else (hf,)
                out.append((mcore.format(i=i), tuple(n.format(i=i) for n in names), layout))
        return out


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int) -> torch.Tensor:
    """HF q [heads*d, ...], k/v [groups*d, ...] -> megatron [groups * (heads/groups + 2) * d, ...],
    each query group's q heads followed by its k and v head."""
    q_groups = q.reshape(num_query_groups, -1, *q.shape[1:])
    k_groups = k.reshape(num_query_groups, -1, *k.shape[1:])
    v_groups = v.reshape(num_query_groups, -1, *v.shape[1:])
    return torch.cat([q_groups, k_groups, v_groups], dim=1).reshape(-1, *q.shape[1:])


def split_qkv(qkv: torch.Tensor, num_query_groups: int, heads_per_group: int, head_dim: int):
    """Inverse of `fuse_qkv`: megatron `linear_qkv` -> (q, k, v) in HF layout."""
    grouped = qkv.reshape(num_query_groups, (heads_per_group + 2) * head_dim, *qkv.shape[1:])
    q, k, v = torch.split(grouped, [heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *qkv.shape[1:]), k.reshape(-1, *qkv.shape[1:]), v.reshape(-1, *qkv.shape[1:]))


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate, up
