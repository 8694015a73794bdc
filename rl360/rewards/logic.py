"""Logic puzzles (Reasoning360 names): the answer is the last <answer> … </answer> after any </think>.

- `logic__zebra_puzzle*`: truth `{"header": [...], "rows": [[...], ...]}` (what
  `data_preprocess/logic/zebra_puzzle.py` writes). The answer is such an object (JSON or a Python literal),
  just its list of rows, or a markdown table whose first line is the header. Partial credit per cell: the
  score is the fraction of cells right at the same row and column, over the truth's cells plus those of
  any extra rows the answer has, so 1.0 means exactly the solved grid. When the answer names the same
  attributes in its header in another order, its columns are matched by name. `acc` is 1.0 only then.
- `logic__ordering*`: truth a list; the answer a list: JSON or a Python literal, else the truth's items
  written in order in prose, as Reasoning360's users' models write them: "The order is Alice, Bob, then
  Carol.", "Final order: ['alice', 'bob', 'carol']" (Reasoning360 reads a [...] list anywhere in the tag),
  '{"order": ["alice", "bob"]}', numbered lines ("1. Alice\\n2. Bob"), bullets, arrows ("Alice -> Bob",
  "→", "=>", ">"), one item per line. Prose is read only when every item of the truth occurs exactly once
  (whole words, any case) and nothing else stands between them: only separators (commas, semicolons, "|",
  arrows, dashes, line breaks, "then", "and", "followed by", "next", "finally", "lastly", quotes, brackets)
  and, when the items are numbered, the labels 1, 2, ... n in order. Before the first item may stand a
  lead-in that ends with ":" or "is" / "are" / "be" ("The order is") and has no "not", "reverse(d)",
  "backwards", "wrong"; after the last, only punctuation. So an item the truth does not have, a missing or
  repeated one, "Alice Bob Carol" or "Alice is after Bob" is not read as a list (then items separated by
  commas, "->" or ">" are compared as written, which such text cannot match). All-or-nothing: 1.0 for the
  exact order, else 0.0 (no partial credit, so a half-right order is not a goal of its own);
  `position_accuracy` in the extras is the fraction of the truth's positions the answer has right, for
  monitoring.
- `logic__graph*`: truth the answer text (a choice letter); "(B)", "B." and "B)" read as "B".

Items and cells compare case-, space- and quote-insensitively. A response without a readable answer scores
0; an unreadable ground truth is a `ValueError` naming it.
"""

from __future__ import annotations

import itertools
import re

from rl360.rewards.extract import last_answer_tag, normalize_text, parse_literal, parse_truth
from rl360.rewards.registry import register_reward

_SEPARATOR_ROW = re.compile(r"^[\s|:\-]+$")
_CHOICE = re.compile(r"^\(?([a-z])\)?[.:)]?$")


@register_reward("logic__zebra_puzzle", truth="JSON {\"header\": [...], \"rows\": [[...], ...]}",
                 answer="the grid in the last <answer> (object, rows or markdown table); credit per cell")
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


@register_reward("logic__ordering", truth="the ordered list (JSON, a Python literal or a list)",
                 answer="the list in the last <answer>: a literal, or the items in order in prose "
                        "(\"A, B, then C\", \"1. A\\n2. B\", \"A -> B\"); exact order only")
def ordering_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """1.0 for the exact order (see the module doc)."""
    truth = parse_truth(ground_truth, "logic__ordering")
    if not isinstance(truth, list) or not truth:
        raise ValueError(f"logic__ordering: ground truth must be a non-empty list, got {str(ground_truth)[:120]!r}")
    want = [normalize_text(x) for x in truth]
    order = _answer_list(solution_str, want)
    if order is None:
        return {"score": 0.0, "position_accuracy": 0.0}
    got = [normalize_text(x) for x in order]
    placed = sum(1 for a, b in zip(got, want) if a == b) / len(want)
    return {"score": float(got == want), "position_accuracy": placed}


def _answer_list(solution_str: str, items: list[str]) -> list | None:
    """The answer's list: a literal, else `items` as the prose of the answer orders them, else the answer's
    text split at commas, arrows or line breaks."""
    answer = last_answer_tag(solution_str)
    if not answer:
        return None
    value = _literal_or(answer, _NOT_A_LITERAL)
    if isinstance(value, (list, tuple)):
        return list(value) or None
    in_prose = items_in_prose(answer, items)  # also a list inside a literal: {"order": [...]}
    if in_prose is not None:
        return in_prose
    if value is _NOT_A_LITERAL:
        text = answer.strip("[]() \n")
        parts = text.split(",") if "," in text else re.split(r"\s*(?:->|→|>|\n)\s*", text)
        value = [part for part in parts if part.strip()]
    return list(value) if isinstance(value, (list, tuple)) and value else None


_NOT_A_LITERAL = object()
_LABEL = re.compile(r"(?:#|\bposition\s*)?(\d+)\s*[.):]", re.IGNORECASE)  # "1.", "2)", "Position 3:"
_LEAD_IN_LABEL = re.compile(r"(?:^|(?<=\s))(?:#|position\s*)?(\d+)\s*[.):][\s'\"`\[(*_-]*$", re.IGNORECASE)
_CONNECTIVES = frozenset({"then", "and", "followed", "by", "next", "finally", "lastly"})
_SEPARATING_MARKS = set(",;.|>→⇒➔-–—•")  # "=" only as part of "=>"
_BETWEEN_MARKS = _SEPARATING_MARKS | set("='\"`[](){}*_")
_QUOTES_AND_BRACKETS = " \t\n'\"`[({*_-•"
_AFTER_LAST = re.compile(r"[\s.,;!'\"`\])}*_]*")
_LEAD_IN_END = re.compile(r"(?:[:：]|\b(?:is|are|be))$", re.IGNORECASE)
_NEGATING = re.compile(r"\b(?:not|no|never|reversed?|backwards?|wrong|incorrect)\b", re.IGNORECASE)


def items_in_prose(text: str, items: list[str]) -> list[str] | None:
    """`items` (normalised) in the order `text` writes them, when the text lists each exactly once with only
    separators between them (see the module doc); None otherwise."""
    names = sorted(set(items), key=len, reverse=True)  # the longest name first: "blue jay" before "jay"
    if not names or not all(names):
        return None
    pattern = "|".join(r"\s+".join(re.escape(word) for word in name.split()) for name in names)
    found = list(itertools.islice(re.finditer(rf"(?<!\w)(?:{pattern})(?!\w)", text, re.IGNORECASE), len(items) + 1))
    if len(found) != len(items):
        return None
    order = [" ".join(match.group(0).lower().split()) for match in found]
    if sorted(order) != sorted(items):
        return None
    lead_in, labels = _read_lead_in(text[:found[0].start()])
    if lead_in is None or not _AFTER_LAST.fullmatch(text[found[-1].end():]):
        return None
    for before, after in zip(found, found[1:]):
        between = _read_between(text[before.end():after.start()])
        if between is None:
            return None
        labels += between
    if labels and labels != list(range(1, len(order) + 1)):
        return None
    return order


def _read_lead_in(text: str) -> tuple[str | None, list[int]]:
    """(the lead-in without a "1." label and quotes or brackets at its end, or None when it cannot precede a
    list; the label's number, if any)."""
    labels = []
    label = _LEAD_IN_LABEL.search(text)
    if label:
        labels.append(int(label.group(1)))
        text = text[:label.start()]
    text = text.rstrip(_QUOTES_AND_BRACKETS).replace("**", "").rstrip()
    if text and (not _LEAD_IN_END.search(text) or _NEGATING.search(text)):
        return None, labels
    return text, labels


def _read_between(text: str) -> list[int] | None:
    """The label numbers in the text between two items, when it is only separators (at least one, beyond
    spaces, quotes and brackets); None otherwise."""
    labels = [int(label.group(1)) for label in _LABEL.finditer(text)]
    tokens = re.findall(r"[^\W_]+|\S", _LABEL.sub(" ", text))
    words = [token for token in tokens if token.isalnum()]
    marks = {token for token in tokens if not token.isalnum()}
    if any(word.lower() not in _CONNECTIVES for word in words) or not marks <= _BETWEEN_MARKS:
        return None
    separated = labels or words or "\n" in text or marks & _SEPARATING_MARKS
    return labels if separated else None


def _literal_or(text: str, default):
    """`text` read as JSON or a Python literal, else `default`."""
    try:
        return parse_literal(text)
    except ValueError:
        return default


@register_reward("logic__graph", truth="the answer text, e.g. a choice letter",
                 answer="the last <answer>; \"(B)\", \"B.\" read as \"B\"")
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
