"""Core attention on torch's own kernels, for GPT layers built without Transformer Engine.

Megatron's local spec computes attention unfused (the whole [b, heads, s, s] score matrix in fp32 softmax) and
refuses packed sequences. `TorchCoreAttention` takes its place in the layer spec (`core_attention`): causal
attention through `torch.nn.functional.scaled_dot_product_attention` (flash / memory-efficient kernels on GPU,
the fused CPU kernel elsewhere), grouped-query heads passed as they are (`enable_gqa`), and the packed `thd`
layout (`PackedSeqParams` with `cu_seqlens_q`): each sequence of the pack attends only within itself. On a CUDA
device with fp16/bf16 inputs the whole pack goes through one flash-attention call over the sequence bounds
(`torch.nn.attention.varlen.varlen_attn`, see `use_varlen`), with no host synchronisation; elsewhere (CPU, fp32)
each sequence runs through SDPA on its own.

With context parallelism (megatron's `context_parallel_size` > 1; megatron's own attention refuses it and
leaves it to Transformer Engine) each rank holds 1/cp of every sequence (`megatron_bridge.context_parallel`):
keys and values are all-gathered over the context-parallel group (gradients reduce-scattered back) and this
rank's queries attend to them under a causal mask of their positions in the whole sequence.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_bridge.context_parallel import context_group, gather, positions_on_rank

try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # torch before 2.10
    _varlen_attn = None
_VARLEN_PARAMETERS = frozenset(inspect.signature(_varlen_attn).parameters) if _varlen_attn is not None else frozenset()
# causal attention: torch 2.11 and later take a (left, right) window, (-1, 0) causal; torch 2.10 took `is_causal`
_VARLEN_CAUSAL = {"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMETERS else \
    {"is_causal": True} if "is_causal" in _VARLEN_PARAMETERS else None
# grouped-query heads: passed as they are where the signature has `enable_gqa`, else expanded (see `_varlen`)
_VARLEN_GQA = "enable_gqa" in _VARLEN_PARAMETERS
VARLEN_DTYPES = (torch.float16, torch.bfloat16)
VARLEN_MAX_HEAD_DIM = 256


def use_varlen(device: torch.device, dtype: torch.dtype, head_dim: int, value_head_dim: int | None = None,
               flash_capable: bool | None = None) -> bool:
    """Whether a packed row of `dtype` q/k/v on `device` goes through one `varlen_attn` call.

    `varlen_attn` runs torch's flash-attention kernels, which exist only on CUDA (compute capability 8.0 or
    later, in a torch built with them), take only fp16/bf16 (they refuse fp32) and head dims that are multiples
    of 8 up to 256, the same for queries, keys and values. Everything else (the CPU tests, fp32 models) keeps the
    per-sequence SDPA path. `flash_capable` overrides the device probe (tests decide it without a GPU)."""
    if device.type != "cuda" or dtype not in VARLEN_DTYPES:
        return False
    if head_dim % 8 or not 0 < head_dim <= VARLEN_MAX_HEAD_DIM or value_head_dim not in (None, head_dim):
        return False
    if _varlen_attn is None or _VARLEN_CAUSAL is None or "scale" not in _VARLEN_PARAMETERS:
        return False
    return _flash_capable(device.index) if flash_capable is None else flash_capable


@functools.lru_cache(maxsize=16)
def _flash_capable(index: int | None) -> bool:
    if not torch.backends.cuda.is_flash_attention_available():
        return False
    return torch.cuda.get_device_capability(index) >= (8, 0)


@dataclasses.dataclass
class HostPackedSeqParams(PackedSeqParams):
    """Megatron's `PackedSeqParams` with the sequence bounds also as Python ints (`host_bounds`, `cu_seqlens_q` as
    the host computed it), so the paths that need them as ints never read them back from the device."""

    host_bounds: tuple[int, ...] | None = None


def sequence_bounds(packed_seq_params) -> list[int]:
    """The pack's sequence bounds as Python ints: the host copy the caller attached (`host_bounds`), else read
    from `cu_seqlens_q` (a host synchronisation when it lives on a GPU)."""
    bounds = getattr(packed_seq_params, "host_bounds", None)
    return list(bounds) if bounds is not None else packed_seq_params.cu_seqlens_q.tolist()


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
            if packed_seq_params.max_seqlen_q is not None and use_varlen(
                    query.device, query.dtype, query.shape[-1], value.shape[-1]):
                return self._varlen(query, key, value, packed_seq_params)
            bounds = sequence_bounds(packed_seq_params)
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
        bounds = sequence_bounds(packed_seq_params)  # of the whole sequences (each padded to 2 x size)
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

    def _varlen(self, query, key, value, packed_seq_params) -> torch.Tensor:
        """Causal attention of a packed row ([t, heads, d], keys and values with their own, fewer, heads) in one
        flash-attention call over the int32 sequence bounds: [t, heads * d]. The longest sequence is the Python
        int in `packed_seq_params`, so nothing waits for the device."""
        heads, kv_heads = query.shape[1], key.shape[1]
        gqa = {}
        if kv_heads != heads:
            if _VARLEN_GQA:
                gqa = {"enable_gqa": True}
            else:  # query head h reads key/value head h // (heads / kv_heads): megatron's grouping, and SDPA's
                key, value = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (key, value))
        bounds = packed_seq_params.cu_seqlens_q
        if bounds.dtype != torch.int32 or bounds.device != query.device:
            bounds = bounds.to(device=query.device, dtype=torch.int32, non_blocking=True)
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
        longest = int(packed_seq_params.max_seqlen_q)
        out = _varlen_attn(q, k, v, bounds, bounds, longest, longest, scale=self.softmax_scale,
                           **_VARLEN_CAUSAL, **gqa)
        return out.reshape(query.shape[0], -1)

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
