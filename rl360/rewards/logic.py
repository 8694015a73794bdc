"""Logic puzzles (Reasoning360 names): the answer is the last <answer> … </answer> after any </think>.

- `logic__zebra_puzzle*`: truth `{"header": [...], "rows": [[...], ...]}` (what
  `data_preprocess/logic/zebra_puzzle.py` writes). The answer is such an object (JSON or a Python literal),
  just its list of rows, or a markdown table whose first line is the header. Partial credit per cell: the
  score is the fraction of cells right at the same row and column, over the truth's cells plus those of
  any extra rows the answer has, so 1.0 means exactly the solved grid. When the answer names the same
  attributes in its header in another order, its columns are matched by name. `acc` is 1.0 only then.
- `logic__ordering*`: truth a list; the answer a list (JSON, a Python literal, or items separated by
  commas, "->" or ">"). All-or-nothing: 1.0 for the exact order, else 0.0 (no partial credit, so a
  half-right order is not a goal of its own); `position_accuracy` in the extras is the fraction of the
  truth's positions the answer has right, for monitoring.
- `logic__graph*`: truth the answer text (a choice letter); "(B)", "B." and "B)" read as "B".

Items and cells compare case-, space- and quote-insensitively. A response without a readable answer scores
0; an unreadable ground truth is a `ValueError` naming it.
"""

from __future__ import annotations

import re

from rl360.rewards.extract import last_answer_tag, normalize_text, parse_literal, parse_truth
from rl360.rewards.registry import register_reward

_SEPARATOR_ROW = re.compile(r"^[\s|:\-]+$")
_CHOICE = re.compile(r"^\(?([a-z])\)?[.:)]?$")


@register_reward("logic__zebra_puzzle")
def zebra_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """Fraction of the solved grid's cells the answer has right (see the module doc)."""
    truth = parse_truth(ground_truth, "logic__zebra_puzzle")
    if (not isinstance(truth, dict) or not isinstance(truth.get("rows"), list) or not truth["rows"]
            or not all(isinstance(row, list) for row in truth["rows"])):
        raise ValueError(f"logic__zebra_puzzle: ground truth needs a non-empty 'rows' list of lists, got "
                         f"{str(ground_truth)[:120]!r}")
    width = max(len(row) for row in truth["rows"])
    grid = _answer_grid(solution_str)
    if grid is None:
        return {"score": 0.0, "acc": 0.0, "cells_right": 0, "cells": width * len(truth["rows"])}
    header, rows = grid
    order = _column_order(truth.get("header"), header)
    right = 0
    for truth_row, row in zip(truth["rows"], rows):
        for column, value in enumerate(truth_row):
            source = order[column] if order else column
            right += source < len(row) and normalize_text(row[source]) == normalize_text(value)
    cells = width * max(len(truth["rows"]), len(rows))
    score = right / cells
    return {"score": score, "acc": float(score == 1.0), "cells_right": right, "cells": cells}


def _answer_grid(solution_str: str) -> tuple[list | None, list[list]] | None:
    """(header or None, rows) of the answer: an object with "rows", a list of rows, or a markdown table."""
    answer = last_answer_tag(solution_str)
    if not answer:
        return None
    value = _literal_or(answer, _NOT_A_LITERAL)
    if value is _NOT_A_LITERAL:
        return _markdown_table(answer)
    header, rows = (value.get("header"), value.get("rows")) if isinstance(value, dict) else (None, value)
    if not isinstance(rows, list) or not all(isinstance(row, (list, tuple)) for row in rows):
        return None
    return (header if isinstance(header, list) else None), [list(row) for row in rows]


def _markdown_table(text: str) -> tuple[list, list[list]] | None:
    """A markdown table's (header, rows); separator lines (|---|) are skipped."""
    lines = [line.strip() for line in text.splitlines() if "|" in line and not _SEPARATOR_ROW.match(line)]
    if len(lines) < 2:
        return None
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return cells[0], cells[1:]


def _column_order(truth_header, answer_header) -> list[int] | None:
    """For each truth column, the answer's column of the same name, when the answer's header holds the
    truth's attributes in another order; None to match columns by position."""
    if not isinstance(truth_header, list) or not isinstance(answer_header, list):
        return None
    names = [normalize_text(name) for name in answer_header]
    wanted = [normalize_text(name) for name in truth_header]
    if sorted(names) != sorted(wanted) or names == wanted or len(set(names)) != len(names):
        return None
    return [names.index(name) for name in wanted]


@register_reward("logic__ordering")
def ordering_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """1.0 for the exact order (see the module doc)."""
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
    if not answer:
        return None
    value = _literal_or(answer, _NOT_A_LITERAL)
    if value is _NOT_A_LITERAL:
        text = answer.strip("[]() \n")
        parts = text.split(",") if "," in text else re.split(r"\s*(?:->|→|>|\n)\s*", text)
        value = [part for part in parts if part.strip()]
    return list(value) if isinstance(value, (list, tuple)) and value else None


_NOT_A_LITERAL = object()


def _literal_or(text: str, default):
    """`text` read as JSON or a Python literal, else `default`."""
    try:
        return parse_literal(text)
    except ValueError:
        return default


@register_reward("logic__graph")
def graph_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """1.0 when the answer names the truth's choice (see the module doc)."""
    if not str(ground_truth).strip():
        raise ValueError(f"logic__graph: empty ground truth {ground_truth!r}")
    answer = last_answer_tag(solution_str)
    correct = bool(answer) and _choice(answer) == _choice(ground_truth)
    return {"score": float(correct), "pred": answer}


def _choice(value) -> str:
    """A choice's normalised text; "(B)", "B." and "B)" give "b"."""
    text = normalize_text(value)
    letter = _CHOICE.match(text)
    return letter.group(1) if letter else text
