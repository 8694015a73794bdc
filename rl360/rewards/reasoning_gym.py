"""`reasoning_gym`: the reasoning-gym package's own scorer for each of its ~100 procedural tasks.

Needs the `reasoning-gym` package (imported when the first row is scored; the route declares it, so data
holding `reasoning_gym` rows fails when it is opened where the package is missing). Rows as Reasoning360 scores them:

- the task name: `extra_info["task"]` (extra_info may be a dict or its JSON text), else a dict ground truth's
  "task", else the entry's `metadata["source_dataset"]` (reasoning-gym writes it into every entry);
- the entry handed to the task's scorer: `extra_info["entry"]`, else a dict ground truth (a whole entry), else
  {"answer": ground_truth}; `extra_info["metadata"]` (a dict or its JSON text) is merged into its metadata,
  which many tasks read (e.g. word_sorting's sorted words). The caller's dicts are never modified;
- the answer: the last <answer> … </answer> after any </think>; else, when the response has a </think>, the
  text after it with any <tags> removed; else the whole response, stripped.

The score is the package's (partial credit included, e.g. its default len(truth)/len(answer) when the answer
contains the truth), with Reasoning360's two corrections: game_of_life_halting, whose package scorer accepts
any non-empty answer, scores the answer equal to the truth (case-insensitively); puzzle24's 0.01 for a wrong
answer is 0.0 unless the answer is an arithmetic expression. A scorer that raises on an answer scores 0.0 (the
error is in the result's "error"). Result: {"score": s, "acc": s, "pred": answer}.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable

from rl360.rewards.extract import last_answer_tag
from rl360.rewards.math import strip_thinking
from rl360.rewards.registry import register_reward

PACKAGE = "reasoning-gym"
_TAG = re.compile(r"<[^>]+>")
_ARITHMETIC = re.compile(r"[0-9+\-*/.() ]+")


@register_reward("reasoning_gym", exact=True, requires=PACKAGE,
                 truth="the entry's answer (task and JSON metadata in extra_info), or the whole entry as a dict",
                 answer="the last <answer>...</answer> (else the text after </think>), scored by reasoning-gym's "
                        "own scorer for the task")
def reasoning_gym_score(solution_str: str, ground_truth, extra_info=None) -> dict:
    """Score one response with reasoning-gym's scorer for the row's task (see the module doc)."""
    info = _as_dict(extra_info, "extra_info")
    entry = _entry(ground_truth, info)
    task = _task_name(ground_truth, info, entry)
    answer = extract_answer(solution_str)
    scorer = score_answer_fn(task)
    try:
        score = float(scorer(answer=answer, entry=entry))
    except Exception as err:  # a task's scorer failing on an odd answer: the answer earns nothing
        return {"score": 0.0, "acc": 0.0, "pred": answer, "error": f"{type(err).__name__}: {err}"}
    score = _corrected(task, answer, entry, score)
    return {"score": score, "acc": score, "pred": answer}


def extract_answer(solution_str: str) -> str:
    """The answer reasoning-gym's scorer is given (see the module doc)."""
    tagged = last_answer_tag(solution_str)
    if tagged is not None:
        return tagged
    if "</think>" in solution_str:
        return _TAG.sub("", strip_thinking(solution_str)).strip()
    return solution_str.strip()


@functools.cache
def score_answer_fn(task: str) -> Callable[..., float]:
    """reasoning-gym's `score_answer(answer=, entry=)` for `task` (built once per process); `ValueError` naming
    the task when the package does not know it."""
    try:
        import reasoning_gym
    except ImportError as err:
        raise ImportError(f"reasoning_gym rows are scored by the {PACKAGE} package: pip install {PACKAGE}") from err
    try:
        return reasoning_gym.get_score_answer_fn(task)
    except ValueError:
        raise ValueError(f"reasoning_gym: task {task!r} is not a reasoning-gym dataset") from None


def _as_dict(value, name: str) -> dict:
    """A dict from a dict, its JSON text, or None (-> {}); `ValueError` naming `name` otherwise."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"reasoning_gym: {name} is text but not JSON: {value[:200]!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"reasoning_gym: {name} must be a dict or its JSON text, got {type(value).__name__}")
    return value


def _entry(ground_truth, info: dict) -> dict:
    """The entry for the task's scorer: a copy, with `extra_info["metadata"]` merged into its metadata."""
    source = info.get("entry")
    if source is not None:
        entry = dict(_as_dict(source, "extra_info['entry']"))
    elif isinstance(ground_truth, dict):
        entry = dict(ground_truth)
    else:
        entry = {"answer": ground_truth}
    metadata = entry.get("metadata")
    metadata = dict(metadata) if isinstance(metadata, dict) else {}
    if info.get("metadata") is not None:
        metadata.update(_as_dict(info["metadata"], "extra_info['metadata']"))
    entry["metadata"] = _plain(metadata)
    if "answer" in entry:
        entry["answer"] = _plain(entry["answer"])
    return entry


def _task_name(ground_truth, info: dict, entry: dict) -> str:
    places = (("extra_info['task']", info.get("task")),
              ("ground_truth['task']", ground_truth.get("task") if isinstance(ground_truth, dict) else None),
              ("metadata['source_dataset']", entry["metadata"].get("source_dataset")))
    for _, name in places:
        if isinstance(name, str) and name:
            return name
    raise ValueError(f"reasoning_gym: no task name in {', '.join(place for place, _ in places)}")


def _plain(value):
    """`value` with numpy arrays and scalars (from pandas-read parquet) turned into lists and Python numbers."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if hasattr(value, "tolist") and type(value).__module__ == "numpy":
        return _plain(value.tolist())
    return value


def _corrected(task: str, answer: str, entry: dict, score: float) -> float:
    """Reasoning360's corrections of two package scorers (see the module doc)."""
    if task == "game_of_life_halting":
        return float(answer.strip().lower() == str(entry.get("answer", "")).strip().lower())
    if task == "puzzle24" and score < 1.0:
        expression = answer.strip()
        looks_arithmetic = (_ARITHMETIC.fullmatch(expression) is not None and any(op in expression for op in "+-*/")
                            and any(ch.isdigit() for ch in expression))
        return score if looks_arithmetic else 0.0
    return score
