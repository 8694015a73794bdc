"""The coefficient of the KL penalty in the reward: fixed, or adaptive towards a target KL."""

from __future__ import annotations

from typing import Any

import torch

from rl360.algos.losses import kl_penalty


class KLController:
    """Fixed when `target` is 0; otherwise adaptive (Ziegler et al., 2019): after a batch of `n` samples
    whose mean KL was `kl`, coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon."""

    def __init__(self, coef: float, target: float = 0.0, horizon: int = 10000):
        self.coef, self.target, self.horizon = coef, target, horizon

    def update(self, kl: float, n: int) -> None:
        if self.target > 0:
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.coef *= 1.0 + error * n / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef}


def kl_in_reward(token_level_rewards: torch.Tensor, batch: Any, controller: KLController,
                 estimator: str) -> tuple[torch.Tensor, dict[str, float]]:
    """The rewards less the KL(policy || reference) penalty on each response token, `controller.coef` times the
    `estimator`'s KL of `batch.old_logprobs` and `batch.ref_logprobs` within `batch.response_mask`; and the metrics
    `reward/kl` (mean KL per sequence) and `reward/kl_coef` (the coefficient used). The controller then adapts
    to that KL."""
    token_kl = kl_penalty(batch.old_logprobs, batch.ref_logprobs, estimator) * batch.response_mask
    penalized = token_level_rewards - controller.coef * token_kl
    sequence_kl = token_kl.sum(-1).mean().item()
    metrics = {"reward/kl": sequence_kl, "reward/kl_coef": controller.coef}
    controller.update(sequence_kl, len(token_level_rewards))
    return penalized, metrics
