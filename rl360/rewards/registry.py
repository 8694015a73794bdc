"""Reward functions by `data_source` (and `extra_info.reward_metric`): routes from names to scorers.

A reward function is `fn(solution_str, ground_truth, extra_info) -> float | dict`; a dict holds "score"
and any extras. A reference ending in `#verl` names a function with verl's signature instead,
`compute_score(data_source, solution_str, ground_truth, extra_info)` (`call_reward` calls either). Each one
is recorded as an importable "module:qualname" reference rather than as the
function object, so the reward pool's worker processes import it themselves: any function defined at
module level in an importable module works there (built-ins, plug-ins, test modules).

A route is a name, matched either as a prefix (`str.startswith`: `math` scores `math__deepscaler`) or,
registered with `exact=True`, only as that whole name (`apps` scores `apps`, not `apps_v2`). Which route
scores a data_source:

0. The route named `*` (verl's `custom_reward_function`: `reward.custom={"*": ...}`) scores every data_source,
   ahead of every other route.
1. Every route whose name matches is a candidate; the longest name wins (an exact name can only be as
   long as the data_source itself). On a tie, which can only be an exact route and a prefix route of the
   same name (`math` and `math`, for the data_source `math`), the later registration wins: built-ins
   first, then a `reward.custom` prefix given at start-up overrides them.
2. `extra_info.reward_metric` (Reasoning360's `prime_math`, `math_llm_judge`, ...) picks a variant: the
   first candidate, in the order above, that registered a scorer under that metric name. No
   reward_metric (absent, None or "") and `"default"` pick the route's default scorer. A reward_metric
   that no candidate knows is an error (`UnknownRewardMetric`, naming the metrics that are known), never
   ignored.

A route can declare `needs_judge=True` (it calls the LLM judge, `rl360.rewards.judge`), so opening data
that uses it without a judge configured fails at start-up, and a one-line `truth` (the ground-truth
format) and `answer` (what counts as the response's answer) from which `docs/rewards.md` is generated
(`python -m rl360.rewards.docs`).
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, TypeAlias

from rl360.data.schema import extra_info_dict
from rl360.errors import UserError
from rl360.imports import import_ref

RewardFn: TypeAlias = Callable[[str, Any, "dict | None"], "float | dict"]

DEFAULT_METRIC = "default"
EVERY = "*"  # the route name that scores every data_source, before any other (verl's custom_reward_function)
VERL_SIGNATURE = "#verl"  # a reference ending so: fn(data_source, solution_str, ground_truth, extra_info)

_ROUTES: dict[tuple[str, bool], dict[str, Route]] = {}  # (name, exact) -> {reward_metric: route}
_RESOLVED: dict[str, RewardFn] = {}  # "module:qualname" -> the function, in this process
_ORDER = itertools.count()  # registration order: the later route wins a tie


@dataclass(frozen=True)
class Route:
    """One registered scorer: `name` matched exactly or as a prefix, for one reward_metric."""

    name: str
    exact: bool
    metric: str  # DEFAULT_METRIC, or the extra_info.reward_metric this variant answers to
    ref: str  # "module:qualname" of the reward function
    truth: str = ""  # the ground-truth format, one line (for docs/rewards.md)
    answer: str = ""  # what counts as the response's answer, one line (for docs/rewards.md)
    needs_judge: bool = False  # it calls the LLM judge: reward.judge must be configured
    requires: str = ""  # a PyPI package the function imports (checked when data is opened)
    runs_code: bool = False  # it runs the response's code in the sandbox (refused where it cannot isolate)
    order: int = 0  # registration sequence number

    @property
    def pattern(self) -> str:
        """The name as docs show it: `apps` (exact) or `math*` (prefix)."""
        return self.name if self.exact else f"{self.name}*"


class RouteError(UserError, KeyError):
    """A data_source / reward_metric that cannot be scored as configured (a `KeyError` whose text reads
    plainly; a `UserError`, as the data or the config must change)."""

    label = "data error"

    def __str__(self) -> str:
        return str(self.args[0])


class UnknownDataSource(RouteError):
    """No registered route matches a data_source."""


class UnknownRewardMetric(RouteError):
    """No route matching a data_source knows its `extra_info.reward_metric`."""


class JudgeNotConfigured(RouteError):
    """Data needs the LLM judge but no judge endpoint is configured."""


class MissingRequirement(RouteError):
    """Data needs a reward whose package is not installed."""


def register_reward(*names: str, exact: bool = False, metric: str = DEFAULT_METRIC, truth: str = "",
                    answer: str = "", needs_judge: bool = False, requires: str = "",
                    runs_code: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator: score every data_source starting with one of `names` (or, with `exact=True`, equal to
    one) with the decorated function; with `metric`, only rows whose `extra_info.reward_metric` names it.
    `truth` and `answer` describe the ground-truth format and the answer read from the response, one line
    each (they appear in docs/rewards.md); `needs_judge` declares that the function calls the LLM judge;
    `requires` names a PyPI package the function imports when it runs (not a dependency of rl360), so data
    that needs it fails when it is opened where the package is missing; `runs_code` declares that it runs
    the response's code in the sandbox, so a run refuses at start where the sandbox cannot isolate it.

    The function must be defined at module level (worker processes import it by name).
    """
    if not names:
        raise ValueError("register_reward needs at least one data_source name or prefix")

    def wrap(fn: RewardFn) -> RewardFn:
        ref = function_ref(fn)
        for name in names:
            _add(Route(name, exact, metric, ref, truth, answer, needs_judge, requires, runs_code))
        _RESOLVED[ref] = fn
        return fn

    return wrap


def register_reward_path(prefix: str, ref: str, *, exact: bool = False, metric: str = DEFAULT_METRIC,
                         truth: str = "", answer: str = "", needs_judge: bool = False, requires: str = "",
                         runs_code: bool = False) -> None:
    """Register the function at "package.module:function" (or "path/file.py:function"; with `#verl`, verl's
    signature) for `prefix` (the `reward.custom` form; the keywords as in `register_reward`); it is imported now,
    so a typo fails at start-up."""
    resolve(ref.removesuffix(VERL_SIGNATURE))
    _add(Route(prefix, exact, metric, ref, truth, answer, needs_judge, requires, runs_code))


def function_ref(fn: Callable[..., Any]) -> str:
    """The "module:qualname" by which another process imports `fn`."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname:  # "<locals>", "<lambda>"
        raise ValueError(
            f"reward function {qualname or fn!r} (module {module}) cannot be imported by worker processes: "
            "define it at module level of an importable module")
    return f"{module}:{qualname}"


def routes() -> list[Route]:
    """Every registered route, sorted by name, prefix routes before exact ones, default metric first."""
    every = [route for variants in _ROUTES.values() for route in variants.values()]
    return sorted(every, key=lambda r: (r.name, r.exact, r.metric != DEFAULT_METRIC, r.metric))


def registered_prefixes() -> list[str]:
    """Every registered route name, sorted (exact names as they are, prefixes with a trailing `*`)."""
    return sorted({(name if exact else f"{name}*") for name, exact in _ROUTES})


def reward_metric_of(extra_info: Any) -> str | None:
    """`extra_info["reward_metric"]` (a map column's list of pairs is read too); None when absent, None,
    "" or a float NaN (pandas' missing value). Another value that is not a string is returned as it is
    (`find_route` refuses it)."""
    extra_info = extra_info_dict(extra_info)
    if not isinstance(extra_info, dict):
        return None
    metric = extra_info.get("reward_metric")
    missing = metric is None or metric == "" or (isinstance(metric, float) and metric != metric)
    return None if missing else metric


def find_route(data_source: str, reward_metric: Any = None) -> Route:
    """The route that scores `data_source` under `reward_metric` (see the module doc); `UnknownDataSource`
    or `UnknownRewardMetric` naming what is wrong and what is registered."""
    candidates = _candidates(data_source)
    if not candidates:
        raise UnknownDataSource(
            f"no reward function for data_source {data_source!r}; registered names (* = prefix): "
            f"{registered_prefixes()} (see docs/rewards.md; add one with rl360.rewards.register_reward or "
            "the reward.custom config)")
    metric = DEFAULT_METRIC if reward_metric is None or reward_metric == "" else reward_metric
    if not isinstance(metric, str):
        raise UnknownRewardMetric(f"data_source {data_source!r}: extra_info.reward_metric must be a string, "
                                  f"got {type(metric).__name__} {metric!r}")
    for variants in candidates:
        if metric in variants:
            return variants[metric]
    known = sorted({name for variants in candidates for name in variants})
    raise UnknownRewardMetric(
        f"data_source {data_source!r} has extra_info.reward_metric {metric!r}, which no reward function "
        f"registered for it answers to; known reward_metric values for it: {known}")


def reward_ref(data_source: str, extra_info: dict | None = None) -> str:
    """The "module:qualname" of the function that scores `data_source` (with `extra_info.reward_metric`
    choosing a variant when given)."""
    return find_route(data_source, reward_metric_of(extra_info)).ref


def get_reward_fn(data_source: str, extra_info: dict | None = None) -> RewardFn:
    """The function that scores `data_source` (and `extra_info.reward_metric`); a `KeyError` naming it
    when nothing matches."""
    return resolve(reward_ref(data_source, extra_info))


def check_data_sources(names: Iterable[str]) -> None:
    """Raise one `UnknownDataSource` (a `KeyError`) listing every name that no route matches."""
    unknown = sorted({str(name) for name in names if not _candidates(name)})
    if unknown:
        raise UnknownDataSource(
            f"no reward function for data_source(s) {unknown}; registered names (* = prefix): "
            f"{registered_prefixes()} (register one with rl360.rewards.register_reward or the reward.custom "
            "config)")


JUDGE_SETTING = "reward.judge.url and reward.judge.model (or RL360_JUDGE_URL and RL360_JUDGE_MODEL)"


def check_route(data_source: str, reward_metric: Any = None, judge_configured: bool = True,
                judge_setting: str = JUDGE_SETTING) -> Route:
    """The route for this data_source and reward_metric, checked for use: `UnknownDataSource`,
    `UnknownRewardMetric`, or `JudgeNotConfigured` (naming `judge_setting`, the setting to fill) when the
    route calls the LLM judge and `judge_configured` is false, or `MissingRequirement` when the package the
    route requires cannot be imported here."""
    route = find_route(data_source, reward_metric)
    if route.requires and importlib.util.find_spec(route.requires.replace("-", "_")) is None:
        raise MissingRequirement(f"data_source {data_source!r} is scored by {route.ref}, which needs the "
                                 f"{route.requires} package: pip install {route.requires}")
    if route.needs_judge and not judge_configured:
        metric = "" if route.metric == DEFAULT_METRIC else f" with extra_info.reward_metric {route.metric!r}"
        raise JudgeNotConfigured(
            f"data_source {data_source!r}{metric} is scored by an LLM judge ({route.ref}), but no judge is "
            f"configured: set {judge_setting} to an OpenAI-compatible endpoint and the model it serves")
    return route


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: dict | None = None) -> float | dict:
    """Score one response in this process, without a timeout: a float, or a dict with "score"."""
    return call_reward(reward_ref(data_source, extra_info), data_source, solution_str, ground_truth, extra_info)


def call_reward(ref: str, data_source: str, solution_str: str, ground_truth: Any,
                extra_info: dict | None) -> float | dict:
    """The function at `ref` called with its signature: rl360's, or verl's for a `#verl` reference."""
    if ref.endswith(VERL_SIGNATURE):
        return resolve(ref.removesuffix(VERL_SIGNATURE))(data_source, solution_str, ground_truth, extra_info)
    return resolve(ref)(solution_str, ground_truth, extra_info)


def resolve(ref: str) -> RewardFn:
    """Import the function named by "module:qualname" (cached per process)."""
    if ref not in _RESOLVED:
        _RESOLVED[ref] = import_ref(ref, "reward")
    return _RESOLVED[ref]


def _add(route: Route) -> None:
    if not isinstance(route.name, str) or not route.name:
        raise ValueError(f"a data_source name or prefix must be a non-empty string, got {route.name!r}")
    if not isinstance(route.metric, str) or not route.metric:
        raise ValueError(f"reward_metric of {route.name!r} must be a non-empty string, got {route.metric!r}")
    for label, text in (("truth", route.truth), ("answer", route.answer)):
        if "\n" in text:
            raise ValueError(f"{label} description of {route.name!r} must be one line, got {text!r}")
    variants = _ROUTES.setdefault((route.name, route.exact), {})
    variants[route.metric] = replace(route, order=next(_ORDER))


def _candidates(data_source: str) -> list[dict[str, Route]]:
    """The routes matching `data_source`, most specific first: longest name, then latest registration."""
    if not isinstance(data_source, str):
        return []
    matching = [variants for (name, exact), variants in _ROUTES.items()
                if name == EVERY or (data_source == name if exact else data_source.startswith(name))]
    return sorted(matching, key=lambda variants: (_any(variants).name != EVERY, -len(_any(variants).name),
                                                  -_latest(variants)))


def _any(variants: dict[str, Route]) -> Route:
    return next(iter(variants.values()))


def _latest(variants: dict[str, Route]) -> int:
    """When the route's default was registered (its latest variant when it has no default)."""
    default = variants.get(DEFAULT_METRIC)
    return default.order if default is not None else max(route.order for route in variants.values())
