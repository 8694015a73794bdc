"""Policy losses, KL estimators and loss aggregation (pure torch; shapes `[batch, response_len]`).

Aggregation takes an explicit global normaliser (tokens or sequences of the whole mini-batch, across
micro-batches), so a mini-batch split into micro-batches gives the gradient of the unsplit batch.
"""

from __future__ import annotations

import torch


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy.

    k1: log r; k2: (log r)^2 / 2; k3: exp(-log r) - 1 + log r (unbiased, non-negative, low variance),
    with log r = logprob - ref_logprob.
    """
    log_ratio = logprob - ref_logprob
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        log_ratio = log_ratio.clamp(-20.0, 20.0)
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise KeyError(f"unknown KL estimator {estimator!r}; choose one of ['k1', 'k2', 'k3']")


def agg_loss(
    loss_mat: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str, global_normalizer: float
) -> torch.Tensor:
    """Aggregate a per-token loss.

    token-mean: sum over all tokens / global token count.
    seq-mean-token-mean: per-sequence token mean, summed / global sequence count.
    seq-mean-token-sum: per-sequence token sum, summed / global sequence count.
    """
    masked = loss_mat * response_mask
    if loss_agg_mode == "token-mean":
        return masked.sum() / global_normalizer
    if loss_agg_mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / response_mask.sum(-1).clamp(min=1)
        return per_seq.sum() / global_normalizer
    if loss_agg_mode == "seq-mean-token-sum":
        return masked.sum(-1).sum() / global_normalizer
    raise KeyError(
        f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of "
        "['token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum']"
    )


def agg_normalizer(response_mask: torch.Tensor, loss_agg_mode: str) -> float:
    """The global count `agg_loss` divides by, computed over a whole mini-batch."""
    if loss_agg_mode == "token-mean":
        return max(float(response_mask.sum()), 1.0)
    return float(max(response_mask.shape[0], 1))


def ppo_clip_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip surrogate, max(-A r, -A clip(r, 1 - low, 1 + high)); also the clipped flags."""
    ratio = torch.exp((logprob - old_logprob).clamp(-20.0, 20.0))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()
