"""Rewards for instruction following: `ood__ifeval` (Google's IFEval) and `ood__ifbench` (AllenAI's IFBench
training constraints), as Reasoning360 stores them.

Ground truth, in either of two forms (both data sources accept both):

- IFBench form: a list of groups `{"instruction_id": [id, ...], "kwargs": [dict | None, ...]}` (one
  kwargs dict per id), or one such group on its own. Reasoning360's IFBench data holds a single group;
  when there are several, every instruction of every group is checked.
- IFEval form (Reasoning360's `ood__ifeval` parquet): a list of kwargs dicts, one per instruction, whose
  ids are in `extra_info["instruction_id_list"]`, in the same order.

Either may arrive as a Python list or tuple, a numpy array (pandas/pyarrow list columns), a JSON string, or
a Python-literal string (single quotes, None). Inside kwargs, None values are dropped (IFEval's parquet
gives every instruction every argument, unused ones None), numpy arrays become lists, numpy scalars
Python numbers, and whole-number floats ints (3.0 -> 3). A kwargs of None means no arguments.

Scoring: text after the last `</think>` is checked, stripped of surrounding whitespace; an empty response
fails every instruction. "score" (and "acc") is 1.0 when every instruction holds and 0.0 otherwise,
Reasoning360's strict rule. Extras: "passed", one bool per instruction in order, and "partial", the
fraction of instructions that hold (Reasoning360's loose per-instruction view; not the reward).

Malformed ground truth (unparseable, empty, ids and kwargs of different lengths, an unknown instruction id,
a missing or wrong argument) raises ValueError naming the fault, so the reward pool counts it as an error.
"""

from __future__ import annotations

import ast
import json
import numbers
from collections.abc import Callable, Mapping
from typing import Any

from rl360.rewards.instructions.ifbench import IFBENCH_CHECKS
from rl360.rewards.instructions.ifeval import IFEVAL_CHECKS
from rl360.rewards.math import strip_thinking
from rl360.rewards.registry import register_reward

Checks = Mapping[str, Callable[..., bool]]
Instruction = tuple[str, dict[str, Any]]

# IFEval's 25 ids and the ids IFBench adds; both data sources resolve every one of them.
INSTRUCTION_CHECKS: dict[str, Callable[..., bool]] = {**IFEVAL_CHECKS, **IFBENCH_CHECKS}


@register_reward("ood__ifeval", "ood__ifbench", exact=True,
                 truth="a list of {instruction_id: [...], kwargs: [...]} (IFBench), or a list of kwargs dicts with "
                       "the ids in extra_info.instruction_id_list (IFEval); list, JSON or Python-literal text",
                 answer="the response after </think>; 1 when every instruction holds (\"partial\": the fraction)")
def instruction_reward(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """`ood__ifeval` and `ood__ifbench`: "score" 1.0 when the response follows every instruction, else 0.0;
    "partial" is the fraction followed (see the module docstring)."""
    return score_instructions(solution_str, parse_instructions(ground_truth, extra_info), INSTRUCTION_CHECKS)


def score_instructions(solution_str: str, instructions: list[Instruction], checks: Checks = INSTRUCTION_CHECKS) -> dict:
    """{"score", "acc", "partial", "passed"} for the response after any </think> (see the module docstring)."""
    response = strip_thinking(solution_str).strip()
    passed = [run_check(checks, instruction_id, kwargs, response) and bool(response)
              for instruction_id, kwargs in instructions]
    score = float(all(passed))
    return {"score": score, "acc": score, "partial": sum(passed) / len(passed), "passed": passed}


def run_check(checks: Checks, instruction_id: str, kwargs: dict[str, Any], response: str) -> bool:
    """Whether `response` follows one instruction; ValueError for an unknown id or arguments that do not fit."""
    check = checks.get(instruction_id)
    if check is None:
        raise ValueError(f"unknown instruction id {instruction_id!r}; known ids: {', '.join(sorted(checks))}")
    try:
        return bool(check(response, **kwargs))
    except TypeError as err:  # an argument the check does not take, or one it needs missing
        raise ValueError(f"instruction {instruction_id!r} with kwargs {kwargs!r}: {err}") from err
    except ValueError as err:
        raise ValueError(f"instruction {instruction_id!r}: {err}") from err


def parse_instructions(ground_truth: Any, extra_info: dict | None) -> list[Instruction]:
    """(instruction id, kwargs) pairs from a ground truth in any accepted form (see the module docstring)."""
    groups = _as_list(_decode(ground_truth), "ground truth")
    if not groups:
        raise ValueError("ground truth holds no instructions")
    if all(isinstance(group, Mapping) and "instruction_id" in group for group in groups):
        pairs = [pair for index, group in enumerate(groups) for pair in _group_pairs(group, index)]
    else:
        pairs = _ifeval_pairs(groups, extra_info)
    if not pairs:
        raise ValueError("ground truth holds no instructions")
    return [(instruction_id, clean_kwargs(kwargs, instruction_id)) for instruction_id, kwargs in pairs]


def clean_kwargs(kwargs: Any, instruction_id: str) -> dict[str, Any]:
    """A kwargs dict as checks take it: None values dropped, numpy values made plain, 3.0 made 3."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"kwargs of instruction {instruction_id!r} must be a dict or None, got {kwargs!r}")
    return {str(key): _plain(value) for key, value in kwargs.items() if value is not None}


def _decode(ground_truth: Any) -> Any:
    if not isinstance(ground_truth, str):
        return ground_truth
    try:
        return json.loads(ground_truth)
    except ValueError:
        pass
    try:
        return ast.literal_eval(ground_truth)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as err:
        raise ValueError(f"ground truth string is neither JSON nor a Python literal: {ground_truth[:200]!r}") from err


def _as_list(value: Any, what: str) -> list[Any]:
    """A list from a list, tuple or numpy array; a single IFBench group becomes a list of one."""
    if isinstance(value, Mapping):
        return [value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{what} must be a list, got {type(value).__name__}: {value!r}")
    return list(value)


def _group_pairs(group: Mapping, index: int) -> list[tuple[str, Any]]:
    ids = group["instruction_id"]
    ids = [ids] if isinstance(ids, str) else _as_list(ids, f"instruction_id of group {index}")
    kwargs = group.get("kwargs")
    kwargs_list = [None] * len(ids) if kwargs is None else _as_list(kwargs, f"kwargs of group {index}")
    if len(kwargs_list) != len(ids):
        raise ValueError(f"group {index} has {len(ids)} instruction ids but {len(kwargs_list)} kwargs")
    return list(zip(_check_ids(ids), kwargs_list))


def _ifeval_pairs(kwargs_list: list[Any], extra_info: dict | None) -> list[tuple[str, Any]]:
    ids = (extra_info or {}).get("instruction_id_list")
    if ids is None:
        raise ValueError("ground truth is a list of kwargs (IFEval form), which needs "
                         "extra_info['instruction_id_list']; none was given")
    ids = _as_list(ids, "extra_info['instruction_id_list']")
    if len(ids) != len(kwargs_list):
        raise ValueError(f"extra_info['instruction_id_list'] has {len(ids)} ids but the ground truth has "
                         f"{len(kwargs_list)} kwargs")
    return list(zip(_check_ids(ids), kwargs_list))


def _check_ids(ids: list[Any]) -> list[str]:
    for instruction_id in ids:
        if not isinstance(instruction_id, str):
            raise ValueError(f"instruction ids must be strings, got {instruction_id!r}")
    return ids


def _plain(value: Any) -> Any:
    """numpy arrays -> lists, numpy scalars -> Python numbers, whole-number floats -> ints."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()  # numpy arrays and scalars alike
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) and float(value).is_integer():
        return int(value)
    return value
