"""Log-probs and entropy from logits split over the vocabulary across tensor-parallel ranks.

Each tensor-parallel rank holds the logits of its slice of the (padded) vocabulary, `[..., V_padded / TP]`.
Instead of gathering the whole vocabulary on every rank (TP times the memory of one slice, for the
largest activation of the model), the softmax statistics are combined with all-reduces of `[...]`-shaped
tensors: the maximum, the sum of exponentials, the target logit and, for the entropy, sum_v e_v z_v.
The bridge's padding columns are cut off first (`without_padding`), so they never enter the normaliser.

The gradient is written out rather than recorded by autograd, so one slice-sized buffer (the
exponentials) is kept between forward and backward, and backward needs one more: with p = softmax(z),
    d log p_t / d z_v = 1[v = t] - p_v,        d H / d z_v = -p_v (log p_v + H).
Every tensor-parallel rank computes the same loss from the reduced values, so each rank's gradient for
its own slice needs no communication. At TP = 1 the reductions are skipped and this is the plain
log-softmax.
"""

from __future__ import annotations

import torch


def without_padding(local_logits: torch.Tensor, vocab_size: int, vocab_start: int) -> torch.Tensor:
    """This rank's logits (its first column is vocabulary id `vocab_start`) without the padding columns."""
    return local_logits[..., :max(0, min(local_logits.shape[-1], vocab_size - vocab_start))]


def logprobs_and_entropy(local_logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                         with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(z)[target] and the entropy of softmax(z), both `[...]`, where z is the whole vocabulary's
    logits and `local_logits` (`[..., V_local]`, fp32) this rank's columns from id `vocab_start` on."""
    logprobs, entropy = _VocabParallelLogprobsEntropy.apply(local_logits, targets, vocab_start, with_entropy)
    return logprobs, (entropy if with_entropy else None)


def _tp_group():
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def _all_reduce(tensor: torch.Tensor, group, op=torch.distributed.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        torch.distributed.all_reduce(tensor, op=op, group=group)
    return tensor


class _VocabParallelLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_logits, targets, vocab_start, with_entropy):
        group = _tp_group()
        width = local_logits.shape[-1]
        row_max = local_logits.amax(-1) if width else local_logits.new_full(targets.shape, float("-inf"))
        _all_reduce(row_max, group, torch.distributed.ReduceOp.MAX)
        shifted = local_logits - row_max[..., None]  # z_v - max: every sum below is free of cancellation
        exp = shifted.exp()  # e_v, kept for backward
        local_ids = targets - vocab_start
        here = (local_ids >= 0) & (local_ids < width)
        local_ids = local_ids.clamp(0, max(width - 1, 0))
        picked = shifted.gather(-1, local_ids[..., None]).squeeze(-1) * here if width else \
            shifted.new_zeros(targets.shape)
        sums = torch.stack([exp.sum(-1), picked])
        if with_entropy:  # sum_v e_v (z_v - max) as a batch of row-by-column products
            sums = torch.cat([sums, torch.matmul(exp[..., None, :], shifted[..., :, None])[..., 0, 0][None]])
        del shifted
        _all_reduce(sums, group)
        log_normalizer = sums[0].log()  # log sum_v e_v
        logprobs = sums[1] - log_normalizer
        # H = -sum_v p_v log p_v = log sum e - sum_v p_v (z_v - max), with p_v = e_v / sum e
        entropy = (log_normalizer - sums[2] / sums[0]) if with_entropy else torch.zeros_like(logprobs)
        ctx.save_for_backward(exp, sums[0], entropy, local_ids, here)
        ctx.with_entropy = with_entropy
        ctx.set_materialize_grads(False)  # an output the loss does not use (e.g. a logged entropy) gets None
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        exp, sum_exp, entropy, local_ids, here = ctx.saved_tensors
        probs = exp.div_(sum_exp[..., None])  # the saved buffer becomes p (backward runs once)
        grad_logprobs = grad_logprobs if grad_logprobs is not None else torch.zeros_like(sum_exp)
        if ctx.with_entropy and grad_entropy is not None:
            grad = torch.xlogy(probs, probs).mul_(-grad_entropy[..., None])  # -g_H p log p
            grad.sub_(probs.mul_((grad_logprobs + grad_entropy * entropy)[..., None]))  # - p (g_lp + g_H H)
        else:
            grad = probs.mul_(-grad_logprobs[..., None])  # - g_lp p
        if grad.shape[-1]:
            grad.scatter_add_(-1, local_ids[..., None], (grad_logprobs * here)[..., None])  # + g_lp 1[v = t]
        return grad, None, None, None
