"""Rewards by `data_source`: the registry, built-in domains, and the timeout-wrapped process pool."""

from rl360.rewards import codegen as _codegen  # noqa: F401  (registers "codegen")
from rl360.rewards import logic as _logic  # noqa: F401  (registers "logic__zebra_puzzle", "logic__ordering", ...)
from rl360.rewards import math as _math  # noqa: F401  (registers "math")
from rl360.rewards import simulation as _simulation  # noqa: F401  (registers "simulation__codeio", ...)
from rl360.rewards import stem as _stem  # noqa: F401  (registers "stem")
from rl360.rewards import table as _table  # noqa: F401  (registers "table")
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
