"""Rewards by `data_source`: the registry, built-in domains, and the timeout-wrapped process pool."""

from rl360.rewards import codegen as _codegen  # noqa: F401  (registers "codegen")
from rl360.rewards import math as _math  # noqa: F401  (registers "math")
from rl360.rewards.pool import RewardItem, RewardPool, RewardResult
from rl360.rewards.registry import (
    check_data_sources,
    compute_score,
    get_reward_fn,
    register_reward,
    register_reward_path,
)

__all__ = [
    "RewardItem", "RewardPool", "RewardResult", "check_data_sources", "compute_score", "get_reward_fn",
    "register_reward", "register_reward_path",
]
