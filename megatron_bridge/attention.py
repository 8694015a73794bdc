"""Core attention on torch's own kernels, for GPT layers built without Transformer Engine.

Megatron's local spec computes attention unfused (the whole [b, heads, s, s] score matrix in fp32 softmax) and
refuses packed sequences. `TorchCoreAttention` takes its place in the layer spec (`core_attention`): causal
attention through `torch.nn.functional.scaled_dot_product_attention` (flash / memory-efficient kernels on GPU,
the fused CPU kernel elsewhere), grouped-query heads passed as they are (`enable_gqa`), and the packed `thd`
layout (`PackedSeqParams` with `cu_seqlens_q`): each sequence of the pack attends only within itself.

With context parallelism (megatron's `context_parallel_size` > 1; megatron's own attention refuses it and
leaves it to Transformer Engine) each rank holds 1/cp of every sequence (`megatron_bridge.context_parallel`):
keys and values are all-gathered over the context-parallel group (gradients reduce-scattered back) and this
rank's queries attend to them under a causal mask of their positions in the whole sequence.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_bridge.context_parallel import context_group, gather, positions_on_rank


class TorchCoreAttention(DotProductAttention):
    """Megatron's `DotProductAttention` interface (head counts and scale from its constructor) on SDPA."""

    def __init__(self, config, *args, **kwargs):
        # megatron's class refuses context parallelism, which this one serves: build it as for one rank
        super().__init__(dataclasses.replace(config, context_parallel_size=1), *args, **kwargs)
        self.config = config

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("TorchCoreAttention takes no attention_bias")
        group = context_group()
        if group is not None:
            if attention_mask is not None:
                raise ValueError("context-parallel attention is causal: it takes no attention_mask")
            return self._context_parallel(query, key, value, packed_seq_params, group)
        if packed_seq_params is not None:  # [t, heads, d]: sequences back to back, cu_seqlens_q their bounds
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed qkv_format {packed_seq_params.qkv_format!r}: only 'thd' is served")
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            parts = [self._attend(query[a:b, None], key[a:b, None], value[a:b, None], None)
                     for a, b in zip(bounds, bounds[1:])]
            return torch.cat(parts, dim=0).reshape(query.shape[0], -1)  # [t, heads * d]
        return self._attend(query, key, value, attention_mask)

    def _context_parallel(self, query, key, value, packed_seq_params, group) -> torch.Tensor:
        """This rank's queries against the whole sequences' keys and values (see the module docstring)."""
        size, rank = group.size(), group.rank()
        if packed_seq_params is None:  # [s_local, b, heads, d]; every row one sequence of s_local * size tokens
            length = query.shape[0] * size
            keys, values = (gather(x, 0, [length], group) for x in (key, value))
            return self._attend(query, keys, values, None, self._causal(length, size, rank, query.device))
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed qkv_format {packed_seq_params.qkv_format!r}: only 'thd' is served")
        bounds = packed_seq_params.cu_seqlens_q.tolist()  # of the whole sequences (each padded to 2 x size)
        lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        keys, values = (gather(x, 0, lengths, group) for x in (key, value))
        parts, local = [], 0
        for start, length in zip(bounds, lengths):
            rows = slice(local, local + length // size)
            whole = slice(start, start + length)
            parts.append(self._attend(query[rows, None], keys[whole, None], values[whole, None], None,
                                      self._causal(length, size, rank, query.device)))
            local += length // size
        return torch.cat(parts, dim=0).reshape(query.shape[0], -1)

    @staticmethod
    def _causal(length: int, size: int, rank: int, device) -> torch.Tensor:
        """[this rank's positions, length]: True where this rank's query may see the key (not after it)."""
        positions = positions_on_rank([length], size, rank, device)
        return positions[:, None] >= torch.arange(length, device=device)[None, :]

    def _attend(self, query, key, value, attention_mask, visible=None) -> torch.Tensor:
        """Causal attention of [s, b, heads, d] inputs (keys and values with their own, fewer, heads):
        [s, b, heads * d]. `visible` ([s_q, s_k], True where a query sees a key) replaces the causal mask."""
        seq, batch = query.shape[0], query.shape[1]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, d]
        mask = visible
        if attention_mask is not None:  # megatron's convention: True where a score is masked out
            causal = torch.ones(seq, key.shape[0], dtype=torch.bool, device=query.device).tril()
            mask = causal & ~attention_mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1])
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)
