"""DAPO's dynamic sampling (keep prompt groups whose scores vary), PyVision's partial dynamic filtering (keep
trajectories one by one) and DAPO's overlong soft penalty."""

from __future__ import annotations

from typing import Any

import torch


def varied_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """[num_groups] bool: True where the group's scores are not all equal (it carries a learning signal).

    Responses of group g are `scores[g * group_size:(g + 1) * group_size]`."""
    grouped = scores.view(-1, group_size)
    return grouped.max(dim=-1).values > grouped.min(dim=-1).values


def group_std(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """[num samples] the population std of each sample's group's scores."""
    return scores.view(-1, group_size).std(dim=-1, unbiased=False).repeat_interleave(group_size)


def partial_keep(scores: torch.Tensor, group_size: int, ending_kept: torch.Tensor) -> torch.Tensor:
    """[num samples] bool: PyVision's partial dynamic filtering of one sampled batch. A trajectory is kept when
    its group's scores vary (a group of one always does) and its own ending is a kept one (`ending_kept`), so a
    group may keep only some of its trajectories."""
    varied = varied_groups(scores, group_size).repeat_interleave(group_size) | (group_size == 1)
    return varied & ending_kept


def trained_rows(batch: Any, scores: torch.Tensor, keep: torch.Tensor | None) -> tuple[Any, torch.Tensor]:
    """Partial dynamic filtering's trajectories trained on: the rows `keep` marks of `batch` (its `select`) and of
    `scores`; both as they are when `keep` is None (every trajectory is trained on)."""
    if keep is None:
        return batch, scores
    return batch.select(keep), scores[keep]


def most_varied(keep: torch.Tensor, stds: torch.Tensor, count: int) -> torch.Tensor:
    """`keep` cut to its `count` trajectories of the largest group std (ties: the earlier sampled first)."""
    if int(keep.sum()) <= count:
        return keep
    order = sorted(keep.nonzero().flatten().tolist(), key=lambda i: -float(stds[i]))
    cut = torch.zeros_like(keep)
    cut[order[:count]] = True
    return cut


def overlong_penalty(lengths: torch.Tensor, max_response_length: int, buffer_length: int,
                     penalty_factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to `max_response_length - buffer_length` tokens, then
    falling linearly to `-penalty_factor` at `max_response_length`."""
    expected = max_response_length - buffer_length
    return (-(lengths.float() - expected) / buffer_length * penalty_factor).clamp(max=0.0)
