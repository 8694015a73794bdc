"""Rewards by `data_source`: the registry, built-in domains, and the timeout-wrapped process pool.

`docs/rewards.md` lists every routed name (`python -m rl360.rewards.docs` writes it from the registry).
"""

from rl360.rewards import agentic as _agentic  # noqa: F401  (registers "vstar", "chart", "deepeyes", ...)
from rl360.rewards import codegen as _codegen  # noqa: F401  (registers "codegen", "apps", "taco", ...)
from rl360.rewards import geometry as _geometry  # noqa: F401  (registers "hiyouga/geometry3k")
from rl360.rewards import gsm8k as _gsm8k  # noqa: F401  (registers "openai/gsm8k")
from rl360.rewards import instructions as _instructions  # noqa: F401  (registers "ood__ifeval", "ood__ifbench")
from rl360.rewards import judged as _judged  # noqa: F401  (registers "stem_web", reward_metric "math_llm_judge")
from rl360.rewards import lewis as _lewis  # noqa: F401  (registers "lewis__speaker", "lewis__listener")
from rl360.rewards import livebench as _livebench  # noqa: F401  (registers "ood__livebench")
from rl360.rewards import logic as _logic  # noqa: F401  (registers "logic__zebra_puzzle", "logic__ordering", ...)
from rl360.rewards import math as _math  # noqa: F401  (registers "math", "math_dapo", "aime", "numina_*", ...)
from rl360.rewards import qa as _qa  # noqa: F401  (registers "searchR1_nq", ...)
from rl360.rewards import reasoning_gym as _reasoning_gym  # noqa: F401  (registers "reasoning_gym")
from rl360.rewards import routes as _routes  # noqa: F401  (registers "stem__gpqa", "stem__supergpqa")
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
