"""Advantage estimators, selected by name (`algorithm.adv_estimator`).

Signatures follow verl's `core_algos` conventions so custom estimators port over:
`fn(token_level_rewards [batch, response_len], response_mask [batch, response_len], index [batch], **kw)
-> (advantages, returns)`, both `[batch, response_len]` and zero outside the mask.
Responses that share an `index` value were sampled from the same prompt (a group).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_advantage_estimator(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    def wrap(fn: AdvantageFn) -> AdvantageFn:
        _ESTIMATORS[name] = fn
        return fn

    return wrap


def get_advantage_estimator(name: str) -> AdvantageFn:
    if name not in _ESTIMATORS:
        raise KeyError(f"unknown advantage estimator {name!r}; choose one of {sorted(_ESTIMATORS)}")
    return _ESTIMATORS[name]


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

    A group of one has mean equal to its score (advantage 0); std is the unbiased sample std.
    """
    scores = token_level_rewards.sum(dim=-1)
    adv = torch.zeros_like(scores)
    for rows in _groups(index).values():
        group = scores[rows]
        if len(rows) == 1:
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
