"""Context parallelism: each of `cp` ranks holds 1/cp of every sequence's tokens, split as megatron splits
them (its RoPE and Transformer Engine's attention assume this layout).

A sequence (padded to a multiple of 2 x cp tokens) is cut into 2 x cp equal chunks; rank r holds chunks r and
2cp-1-r, so every rank has as many early (cheap) as late (expensive) causal-attention rows. Sequences laid back
to back (a padded batch's rows, or the packed THD row) are each split that way, and a rank's tokens are its
share of the first sequence, then of the second, and so on.

`positions_on_rank` says which tokens of the whole a rank holds; `gather` is the differentiable all-gather
that puts every rank's tokens back in sequence order (its backward sums each rank's gradient share over the
group: a reduce-scatter). Attention gathers keys and values with it; the policy gathers per-token log-probs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def context_group():
    """megatron's context-parallel group, or None when context parallelism is off."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_context_parallel_world_size() == 1:
        return None
    return parallel_state.get_context_parallel_group()


def positions_on_rank(lengths: list[int], size: int, rank: int, device=None) -> torch.Tensor:
    """Indices, in the sequences laid back to back, of the tokens context-parallel rank `rank` of `size` holds;
    each length must be a multiple of 2 x size."""
    parts, start = [], 0
    for length in lengths:
        if length % (2 * size):
            raise ValueError(f"a sequence of {length} tokens cannot be split over {size} context-parallel ranks "
                             f"(pad it to a multiple of {2 * size})")
        chunk = length // (2 * size)
        for index in (rank, 2 * size - 1 - rank):
            parts.append(torch.arange(start + index * chunk, start + (index + 1) * chunk, device=device))
        start += length
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def local_part(full: torch.Tensor, dim: int, lengths: list[int], group) -> torch.Tensor:
    """This rank's tokens of `full` (sequences of `lengths` back to back along `dim`)."""
    index = positions_on_rank(lengths, group.size(), group.rank(), full.device)
    return full.index_select(dim, index)


def gather(local: torch.Tensor, dim: int, lengths: list[int], group) -> torch.Tensor:
    """Every rank's `local` tokens (along `dim`) back in sequence order: the whole of the sequences."""
    pieces = _AllGather.apply(local.contiguous(), dim, group)  # [size * n_local] along dim, rank after rank
    order = torch.cat([positions_on_rank(lengths, group.size(), rank, local.device) for rank in range(group.size())])
    return pieces.index_select(dim, torch.argsort(order))


class _AllGather(torch.autograd.Function):
    """All-gather along `dim` (ranks in order); backward: the sum over ranks of the gradient of this rank's part."""

    @staticmethod
    def forward(ctx, local, dim, group):
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(local) for _ in range(group.size())]
        dist.all_gather(parts, local, group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        size = ctx.group.size()
        stacked = torch.stack(grad.chunk(size, dim=ctx.dim)).contiguous()  # [size, ...local shape]
        out = torch.empty_like(stacked[0])
        dist.reduce_scatter_tensor(out.view(-1), stacked.view(-1), group=ctx.group)  # flat: gloo splits dim 0
        return out, None, None
