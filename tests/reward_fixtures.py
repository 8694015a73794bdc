"""Reward functions that misbehave, importable by the reward pool's worker processes."""

import os
import time

from rl360.rewards import register_reward


@register_reward("test_hang")
def never_returns(solution_str, ground_truth, extra_info=None):
    while True:
        time.sleep(1)


@register_reward("test_raise")
def raises(solution_str, ground_truth, extra_info=None):
    raise ValueError(f"bad response {solution_str!r}")


@register_reward("test_exit")
def exits(solution_str, ground_truth, extra_info=None):
    os._exit(3)


@register_reward("test_echo")
def echo(solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth), "seen": extra_info}
