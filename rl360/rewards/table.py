"""`table__*` (FinQA, HiTab, MultiHiertt): the last \\boxed{} after any </think> against the ground truth.

Answers separated by "|" are a list, compared as a multiset (order free: HiTab's answers are cell sets).
Two answers match when both read as numbers ("1,234.5", "$3", "12%") within 1e-4 relative — a percentage
also matches its fraction (14.1% ~ 0.141, as FinQA's answers and computed values differ) — or else as
text, case- and space-insensitively.
"""

from __future__ import annotations

from rl360.rewards.extract import as_number, normalize_text, numbers_close
from rl360.rewards.math import last_boxed, strip_thinking
from rl360.rewards.registry import register_reward

RELATIVE_TOLERANCE = 1e-4


def answers_match(pred: str, truth: str, rel: float = RELATIVE_TOLERANCE) -> bool:
    x, y = as_number(pred), as_number(truth)
    if x is not None and y is not None:
        candidates = {x, x / 100, x * 100} if ("%" in pred) != ("%" in truth) else {x}
        return any(numbers_close(c, y, rel) for c in candidates)
    return normalize_text(pred) == normalize_text(truth)


@register_reward("table")
def table_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    pred = last_boxed(strip_thinking(solution_str))
    if pred is None:
        return {"score": 0.0, "pred": None}
    wanted = [part.strip() for part in str(ground_truth).split("|")]
    given = [part.strip() for part in pred.replace("\\%", "%").split("|")]
    remaining = list(wanted)
    for answer in given:
        match = next((i for i, truth in enumerate(remaining) if answers_match(answer, truth)), None)
        if match is None:
            return {"score": 0.0, "pred": pred}
        remaining.pop(match)
    return {"score": float(not remaining), "pred": pred}
