"""Reward functions that misbehave, importable by the reward pool's worker processes."""

import ctypes
import os
import subprocess
import sys
import time

from rl360.rewards import register_reward


@register_reward("test_hang")
def never_returns(solution_str, ground_truth, extra_info=None):
    while True:
        time.sleep(1)


@register_reward("test_sleep")
def sleeps_then_scores(solution_str, ground_truth, extra_info=None):
    """Sleeps `solution_str` seconds, then scores 1."""
    time.sleep(float(solution_str))
    return 1.0


@register_reward("test_raise")
def raises(solution_str, ground_truth, extra_info=None):
    raise ValueError(f"bad response {solution_str!r}")


@register_reward("test_exit")
def exits(solution_str, ground_truth, extra_info=None):
    os._exit(3)


@register_reward("test_segfault")
def segfaults(solution_str, ground_truth, extra_info=None):
    ctypes.string_at(0)  # reads address 0: SIGSEGV


@register_reward("test_allocate")
def allocates(solution_str, ground_truth, extra_info=None):
    """Allocates `solution_str` bytes; scores 1 when that succeeds."""
    block = bytearray(int(solution_str))
    return float(len(block) > 0)


@register_reward("test_child_hang")
def starts_child_and_hangs(solution_str, ground_truth, extra_info=None):
    """Starts a long-lived child process, writes its pid to the file `solution_str`, then hangs."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(solution_str, "w") as handle:
        handle.write(str(child.pid))
    never_returns(solution_str, ground_truth)


@register_reward("test_echo")
def echo(solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth), "seen": extra_info}


@register_reward("test_echo__special")
def echo_special(solution_str, ground_truth, extra_info=None):
    return {"score": 0.5, "seen": "special"}


@register_reward("test_no_score")
def no_score_key(solution_str, ground_truth, extra_info=None):
    return {"value": 1.0}


@register_reward("test_rendezvous")
def rendezvous(solution_str, ground_truth, extra_info=None):
    """Leaves a mark in the directory `solution_str` and waits (10 s at most) until `ground_truth` marks
    are there: scores 1 only if that many calls ran at the same time."""
    os.makedirs(solution_str, exist_ok=True)
    with open(os.path.join(solution_str, str(os.getpid())), "w"):
        pass
    for _ in range(200):
        if len(os.listdir(solution_str)) >= int(ground_truth):
            return 1.0
        time.sleep(0.05)
    return 0.0


@register_reward("test_fork_exit")
def forks_then_exits(solution_str, ground_truth, extra_info=None):
    """Forks a child that keeps every inherited descriptor (the worker's pipe too), then dies."""
    if os.fork() == 0:
        time.sleep(600)
        os._exit(0)
    os._exit(4)


@register_reward("test_env")
def env_value(solution_str, ground_truth, extra_info=None):
    """The value of the environment variable named by the response, as the worker sees it."""
    return float(os.environ.get(solution_str, "-1"))
