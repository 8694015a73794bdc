"""Logic puzzles (Reasoning360 names): the answer is the last <answer> … </answer> after any </think>.

- `logic__zebra_puzzle*`: truth `{"header": [...], "rows": [[...], ...]}`; the answer is such an object (or
  just its rows). Partial credit per cell: the score is the fraction of the truth's cells the answer has
  right at the same row and column (1.0 only when all are), compared case- and space-insensitively.
- `logic__ordering*`: truth a list; the answer a list (JSON, a Python literal, or comma-separated). 1.0 for
  the exact order; `position_accuracy` in the extras tells how many places were right.
- `logic__graph*`: truth the answer text; the answer compared case- and space-insensitively.
A response without a readable answer scores 0; an unreadable ground truth is a `ValueError`.
"""

from __future__ import annotations

from rl360.rewards.extract import last_answer_tag, normalize_text, parse_literal, parse_truth
from rl360.rewards.registry import register_reward


@register_reward("logic__zebra_puzzle")
def zebra_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    truth = parse_truth(ground_truth, "logic__zebra_puzzle")
    if not isinstance(truth, dict) or not isinstance(truth.get("rows"), list):
        raise ValueError(f"logic__zebra_puzzle: ground truth needs a 'rows' list, got {str(ground_truth)[:120]!r}")
    rows = _answer_rows(solution_str)
    cells = sum(len(row) for row in truth["rows"])
    if rows is None or not cells:
        return {"score": 0.0, "cells_right": 0, "cells": cells}
    right = sum(1 for r, truth_row in enumerate(truth["rows"]) for c, value in enumerate(truth_row)
                if r < len(rows) and isinstance(rows[r], (list, tuple)) and c < len(rows[r])
                and normalize_text(rows[r][c]) == normalize_text(value))
    return {"score": right / cells, "cells_right": right, "cells": cells}


def _answer_rows(solution_str: str) -> list | None:
    answer = last_answer_tag(solution_str)
    if answer is None:
        return None
    try:
        value = parse_literal(answer)
    except ValueError:
        return None
    rows = value.get("rows") if isinstance(value, dict) else value
    return rows if isinstance(rows, list) else None


@register_reward("logic__ordering")
def ordering_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    truth = parse_truth(ground_truth, "logic__ordering")
    if not isinstance(truth, list) or not truth:
        raise ValueError(f"logic__ordering: ground truth must be a non-empty list, got {str(ground_truth)[:120]!r}")
    order = _answer_list(solution_str)
    if order is None:
        return {"score": 0.0, "position_accuracy": 0.0}
    want = [normalize_text(x) for x in truth]
    got = [normalize_text(x) for x in order]
    placed = sum(1 for a, b in zip(got, want) if a == b) / len(want)
    return {"score": float(got == want), "position_accuracy": placed}


def _answer_list(solution_str: str) -> list | None:
    answer = last_answer_tag(solution_str)
    if answer is None:
        return None
    try:
        value = parse_literal(answer)
    except ValueError:
        value = [part for part in answer.strip("[]() ").split(",") if part.strip()]
    return list(value) if isinstance(value, (list, tuple)) else None


@register_reward("logic__graph")
def graph_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    answer = last_answer_tag(solution_str)
    correct = answer is not None and normalize_text(answer) == normalize_text(ground_truth)
    return {"score": float(correct), "pred": answer}
