"""DAPO's dynamic sampling (keep prompt groups whose scores vary) and overlong soft penalty."""

from __future__ import annotations

import torch


def varied_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """[num_groups] bool: True where the group's scores are not all equal (it carries a learning signal).

    Responses of group g are `scores[g * group_size:(g + 1) * group_size]`."""
    grouped = scores.view(-1, group_size)
    return grouped.max(dim=-1).values > grouped.min(dim=-1).values


def overlong_penalty(lengths: torch.Tensor, max_response_length: int, buffer_length: int,
                     penalty_factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to `max_response_length - buffer_length` tokens, then
    falling linearly to `-penalty_factor` at `max_response_length`."""
    expected = max_response_length - buffer_length
    return (-(lengths.float() - expected) / buffer_length * penalty_factor).clamp(max=0.0)
