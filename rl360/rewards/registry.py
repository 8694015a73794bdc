"""Reward functions by `data_source` prefix (the longest registered prefix wins).

A reward function is `fn(solution_str, ground_truth, extra_info) -> float | dict` (a dict holds "score"
and any extras). Each is recorded as an importable "module:qualname" reference, so worker processes of
the reward pool import it themselves: a function defined at module level anywhere importable works.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

RewardFn = Callable[[str, str, Any], "float | dict"]
_REFS: dict[str, str] = {}  # data_source prefix -> "module:qualname"


def register_reward(*prefixes: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: score data sources starting with any of `prefixes` with the decorated function."""

    def wrap(fn: RewardFn) -> RewardFn:
        for prefix in prefixes:
            _REFS[prefix] = f"{fn.__module__}:{fn.__qualname__}"
        return fn

    return wrap


def register_reward_path(prefix: str, ref: str) -> None:
    """Register "package.module:function" (checked now: it must import) for `prefix`."""
    resolve(ref)
    _REFS[prefix] = ref


def reward_ref(data_source: str) -> str:
    """The "module:qualname" of the function scoring `data_source`."""
    matches = [prefix for prefix in _REFS if data_source.startswith(prefix)]
    if not matches:
        raise KeyError(f"no reward function for data_source {data_source!r}; registered prefixes: {sorted(_REFS)}")
    return _REFS[max(matches, key=len)]


def get_reward_fn(data_source: str) -> RewardFn:
    return resolve(reward_ref(data_source))


def check_data_sources(names: Iterable[str]) -> None:
    """Raise once, listing every data_source that no registered prefix matches."""
    unknown = sorted({n for n in names if not any(n.startswith(p) for p in _REFS)})
    if unknown:
        raise KeyError(f"no reward function for data_source {unknown}; registered prefixes: {sorted(_REFS)}")


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None):
    """Score one response in this process (no timeout): a float or a dict with "score"."""
    return get_reward_fn(data_source)(solution_str, ground_truth, extra_info)


_RESOLVED: dict[str, RewardFn] = {}


def resolve(ref: str) -> RewardFn:
    """Import "module:qualname" (cached)."""
    if ref not in _RESOLVED:
        module_name, _, qualname = ref.partition(":")
        if not qualname:
            raise ValueError(f"reward reference {ref!r} is not of the form 'module:function'")
        target: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            target = getattr(target, part)
        _RESOLVED[ref] = target
    return _RESOLVED[ref]
