"""The coefficient of the KL penalty in the reward: fixed, or adaptive towards a target KL."""

from __future__ import annotations


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
