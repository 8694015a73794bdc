"""Advantage estimators, selected by name (`algorithm.adv_estimator`).

Signatures follow verl's `core_algos` conventions so custom estimators port over:
`fn(token_level_rewards [batch, response_len], response_mask [batch, response_len], index [batch], **kw)
-> (advantages, returns)`, both `[batch, response_len]` and zero outside the mask.
Responses that share an `index` value were sampled from the same prompt (a group).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from rl360.algos.registry import Registry

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")
register_advantage_estimator = ESTIMATORS.register
get_advantage_estimator = ESTIMATORS.get
advantage_estimators = ESTIMATORS.names


def token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Each response's score on its last generated token (the last one trained on; tool tokens after it get
    none), zeros elsewhere: `[batch, response_len]`."""
    rewards = torch.zeros_like(response_mask)
    slots = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)
    last = (((response_mask > 0) * slots).amax(-1) - 1).clamp(min=0)
    rewards[torch.arange(len(response_mask)), last] = scores
    return rewards


def compute_advantages(estimator: AdvantageFn, token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                       group_size: int, algorithm: Any, reward_baselines: torch.Tensor | None = None,
                       values: torch.Tensor | None = None, keep: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) of a step's responses: `estimator` called once over all of them, each `group_size`
    consecutive rows one prompt's group, with the `algorithm` section's `norm_adv_by_std_in_grpo`, `gamma` and
    `lam`. `keep` ([batch] bool, partial dynamic filtering): the rows returned, their groups' advantages taken over
    every response sampled."""
    index = [row // group_size for row in range(len(token_level_rewards))]
    advantages, returns = estimator(
        token_level_rewards, response_mask, index, norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
        gamma=algorithm.gamma, lam=algorithm.lam, reward_baselines=reward_baselines, values=values)
    return (advantages, returns) if keep is None else (advantages[keep], returns[keep])


def _groups(index: Sequence) -> dict[object, list[int]]:
    groups: dict[object, list[int]] = {}
    for row, key in enumerate(index):
        groups.setdefault(key.item() if isinstance(key, torch.Tensor) else key, []).append(row)
    return groups


@register_advantage_estimator("grpo")
def grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: (score - group mean) / (group std + eps); without the std division, Dr.GRPO.

    A group of one has mean equal to its score (advantage 0); std is the unbiased sample std. A group of
    equal scores gets exactly 0: in float32 their mean can round off the score (3 x 0.9 / 3 != 0.9), and
    dividing that rounding error by std + eps = eps would make it an advantage of a few percent.
    """
    scores = token_level_rewards.sum(dim=-1)
    adv = torch.zeros_like(scores)
    for rows in _groups(index).values():
        group = scores[rows]
        if bool((group == group[0]).all()):
            continue
        centred = group - group.mean()
        adv[rows] = centred / (group.std() + epsilon) if norm_adv_by_std_in_grpo else centred
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_advantage_estimator("rloo")
def rloo_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence, **_: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: score minus the mean score of the other responses of the same prompt."""
    scores = token_level_rewards.sum(dim=-1)
    adv = torch.zeros_like(scores)
    for rows in _groups(index).values():
        n = len(rows)
        if n > 1:
            adv[rows] = (scores[rows] - scores[rows].mean()) * n / (n - 1)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, epsilon: float = 1e-8) -> torch.Tensor:
    """(values - mean) / std over the masked entries of the whole batch (unbiased variance)."""
    count = mask.sum().clamp(min=1)
    mean = (values * mask).sum() / count
    var = ((values - mean).square() * mask).sum() / (count - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + epsilon) * mask


@register_advantage_estimator("reinforce_plus_plus")
def reinforce_plus_plus_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence | None = None,
    gamma: float = 1.0, **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go R_t = sum_{k >= t} gamma^(k - t) r_k of each token (rewards outside
    the mask count as 0), whitened over all tokens of the batch."""
    rewards = token_level_rewards * response_mask
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    returns = returns * response_mask
    return masked_whiten(returns, response_mask), returns


@register_advantage_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence, **_: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: score minus its group's mean, whitened over the batch's tokens."""
    centred, _ = grpo_advantage(token_level_rewards, response_mask, index, norm_adv_by_std_in_grpo=False)
    return masked_whiten(centred, response_mask), centred


@register_advantage_estimator("opo")
def opo_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence, **_: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: score minus the length-weighted group mean, b = sum_i |y_i| r_i / sum_i |y_i|."""
    scores = token_level_rewards.sum(dim=-1)
    lengths = response_mask.sum(dim=-1)
    adv = torch.zeros_like(scores)
    for rows in _groups(index).values():
        if len(rows) > 1:
            baseline = (lengths[rows] * scores[rows]).sum() / lengths[rows].sum().clamp(min=1)
            adv[rows] = scores[rows] - baseline
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_advantage_estimator("grpo_passk")
def grpo_passk_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence,
    norm_adv_by_std_in_grpo: bool = True, epsilon: float = 1e-6, **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO: only each group's best response gets an advantage, r_best - r_second
    (divided by the group std unless Dr.GRPO style)."""
    scores = token_level_rewards.sum(dim=-1)
    adv = torch.zeros_like(scores)
    for rows in _groups(index).values():
        if len(rows) < 2:
            continue
        group = scores[rows]
        top = torch.topk(group, 2)
        value = top.values[0] - top.values[1]
        if norm_adv_by_std_in_grpo:
            value = value / (group.std() + epsilon)
        adv[rows[int(top.indices[0])]] = value
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_advantage_estimator("remax")
def remax_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence | None = None,
    reward_baselines: torch.Tensor | None = None, **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al., 2023): return-to-go of each token minus the score of the greedy response to the
    same prompt (`reward_baselines`, [batch]; the trainer samples and scores it)."""
    if reward_baselines is None:
        raise ValueError("remax needs reward_baselines: the scores of greedy responses to the same prompts")
    returns = (token_level_rewards * response_mask).flip(-1).cumsum(-1).flip(-1) * response_mask
    adv = returns - reward_baselines.unsqueeze(-1) * response_mask
    return adv, returns


@register_advantage_estimator("gpg")
def gpg_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence, **_: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al., 2025): alpha * (score - group mean), alpha = B / (B - M) where M counts the responses
    in groups whose scores are all equal (their advantage is 0, so the others are scaled up to keep the
    batch's gradient scale). A group of one counts as uniform. Use with `actor.loss_mode=gpg`.

    (verl's implementation takes alpha = B / (number of non-zero scores) instead.)"""
    scores = token_level_rewards.sum(dim=-1)
    adv = torch.zeros_like(scores)
    uniform = 0
    for rows in _groups(index).values():
        group = scores[rows]
        if len(rows) == 1 or bool((group == group[0]).all()):
            uniform += len(rows)
            continue
        adv[rows] = group - group.mean()
    alpha = len(scores) / max(len(scores) - uniform, 1)
    adv = alpha * adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_advantage_estimator("gae")
def gae_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence | None = None,
    values: torch.Tensor | None = None, gamma: float = 1.0, lam: float = 1.0, **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al., 2016) for PPO: delta_t = r_t + gamma V_{t+1} - V_t over the response tokens
    (V after the last token is 0; positions outside the mask are skipped), A_t = sum_k (gamma lam)^k
    delta_{t+k}; returns A_t + V_t are the critic's targets; the advantages are whitened over the batch."""
    if values is None:
        raise ValueError("gae needs values: the critic's value of every response position")
    values = values * response_mask
    advantages = torch.zeros_like(token_level_rewards)
    next_value = token_level_rewards.new_zeros(token_level_rewards.shape[0])
    running = torch.zeros_like(next_value)
    for t in reversed(range(token_level_rewards.shape[1])):
        mask = response_mask[:, t]
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        running = step * mask + running * (1 - mask)  # a masked position passes the later ones through
        next_value = values[:, t] * mask + next_value * (1 - mask)
        advantages[:, t] = running
    returns = (advantages + values) * response_mask
    return masked_whiten(advantages, response_mask), returns
