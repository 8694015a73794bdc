"""Core attention on torch's own kernels, for GPT layers built without Transformer Engine.

Megatron's local spec computes attention unfused (the whole [b, heads, s, s] score matrix in fp32 softmax) and
refuses packed sequences. `TorchCoreAttention` takes its place in the layer spec (`core_attention`): causal
attention through `torch.nn.functional.scaled_dot_product_attention` (flash / memory-efficient kernels on GPU,
the fused CPU kernel elsewhere), grouped-query heads passed as they are (`enable_gqa`), and the packed `thd`
layout (`PackedSeqParams` with `cu_seqlens_q`): each sequence of the pack attends only within itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class TorchCoreAttention(DotProductAttention):
    """Megatron's `DotProductAttention` interface (head counts and scale from its constructor) on SDPA."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("TorchCoreAttention takes no attention_bias")
        if packed_seq_params is not None:  # [t, heads, d]: sequences back to back, cu_seqlens_q their bounds
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed qkv_format {packed_seq_params.qkv_format!r}: only 'thd' is served")
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            parts = [self._attend(query[a:b, None], key[a:b, None], value[a:b, None], None)
                     for a, b in zip(bounds, bounds[1:])]
            return torch.cat(parts, dim=0).reshape(query.shape[0], -1)  # [t, heads * d]
        return self._attend(query, key, value, attention_mask)

    def _attend(self, query, key, value, attention_mask) -> torch.Tensor:
        """Causal attention of [s, b, heads, d] inputs (keys and values with their own, fewer, heads):
        [s, b, heads * d]."""
        seq, batch = query.shape[0], query.shape[1]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, d]
        mask = None
        if attention_mask is not None:  # megatron's convention: True where a score is masked out
            causal = torch.ones(seq, key.shape[0], dtype=torch.bool, device=query.device).tril()
            mask = causal & ~attention_mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1])
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)
