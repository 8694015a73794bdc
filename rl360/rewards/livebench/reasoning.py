"""LiveBench's reasoning tasks: web_of_lies_v2, web_of_lies_v3, house_traversal, zebra_puzzle, spatial.

Each scorer takes the response (thinking already stripped), the ground truth and the row's extra_info,
and returns a score in [0, 1].
"""

from __future__ import annotations

import re

from rl360.rewards.livebench.answers import (
    NEW_FORMAT_DATE,
    boxed_text,
    last_solution,
    release_date,
    solution_tags,
    truth_text,
)

_VERDICT = r"(yes|no|unknown)"
_VERDICT_WORD = re.compile(rf"\b{_VERDICT}\b")
# Overlapping matches, so that the last "a, b, c" of "yes, no, yes, no" is "no, yes, no".
_VERDICT_TRIPLE = re.compile(rf"(?=\b{_VERDICT}, {_VERDICT}, {_VERDICT}\b)")
_BOLD = re.compile(r"\*\*(.*?)\*\*")
_BOLD_ANY_STARS = re.compile(r"(\*{2,})(.*?)\1")
_BOLD_NO_STARS = re.compile(r"\*\*([^*]+)\*\*")
_TRIPLE_BOLD_WORD = re.compile(r"\*\*\*(\w+)\*\*\*")
_WORD = re.compile(r"\b\w+\b")
_DIGIT_WORDS = {str(n): word for n, word in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())}
_SHAPES = ("tetrahedra", "tetrahedron", "triangle", "square")


def web_of_lies_v2_score(response: str, ground_truth, extra_info: dict) -> float:
    """Three verdicts ("yes, no, unknown") from <solution>, else the last three yes/no/unknown words in bold,
    else \\boxed{}, else the last "x, y, z" in the text; 1.0 when all three match in order, else 0.0."""
    wanted = _verdicts(truth_text(ground_truth, "web_of_lies_v2"), "web_of_lies_v2")
    answer = _nonempty(last_solution(response))
    if answer is None:
        bold_words = [_VERDICT_WORD.findall(span.lower()) for span in _BOLD.findall(response)]
        last_three = [word for words in bold_words for word in words][-3:]
        answer = ", ".join(last_three) or None
    if answer is None:
        answer = _nonempty(_boxed_with_bold(response))
    if answer is None:
        answer = _last_verdict_triple(response)
    return float(answer is not None and _VERDICT_WORD.findall(answer.lower()) == wanted)


def web_of_lies_v3_score(response: str, ground_truth, extra_info: dict) -> float:
    """Verdicts ("yes, no, unknown") from <solution>, else \\boxed{}, else the last "x, y, z" in the text,
    compared position by position: (all right + fraction right) / 2."""
    wanted = _verdicts(truth_text(ground_truth, "web_of_lies_v3"), "web_of_lies_v3")
    answer = _nonempty(last_solution(response)) or _nonempty(_boxed_with_bold(response))
    if answer is None:
        answer = _last_verdict_triple(response)
    if answer is None:
        return 0.0
    given = [_clean_cell(cell) for cell in answer.split(",")]
    return _all_and_fraction(sum(g == w for g, w in zip(given, wanted)), len(wanted))


def house_traversal_score(response: str, ground_truth, extra_info: dict) -> float:
    """Names along a path, space-separated in the truth ("Alice Bob Carol"); 1.0 when the last bold spans hold
    them one per span in order, or the last bold span holds them all in order, else 0.0."""
    names = truth_text(ground_truth, "house_traversal").lower().split()
    spans = [match.group(2) for match in _BOLD_ANY_STARS.finditer(response.lower())]
    if not spans:
        return 0.0
    if len(spans) >= len(names) and all(name in span for name, span in zip(names, spans[-len(names):])):
        return 1.0
    position = 0
    for name in names:
        found = spans[-1].find(name, position)
        if found < 0:
            return 0.0
        position = found + len(name)
    return 1.0


def zebra_puzzle_score(response: str, ground_truth, extra_info: dict) -> float:
    """Before 2024-11-25 one answer ("3", "cricket") in ***bold*** (else the last word), 1.0 or 0.0; from then
    on comma-separated cells ("3,cricket,red") in <solution> scored cell by cell: (all right + fraction) / 2.
    Without a release date, a truth with commas is read as cells."""
    truth = truth_text(ground_truth, "zebra_puzzle")
    released = release_date(extra_info)
    if released is None:
        per_cell = "," in truth
    else:
        per_cell = released >= NEW_FORMAT_DATE
    return _zebra_cells(response, truth) if per_cell else _zebra_single(response, truth)


def spatial_score(response: str, ground_truth, extra_info: dict) -> float:
    """A number, shape or phrase ("3", "triangle"); 1.0 when one of the last three bold spans says it (a number
    may be spelled out; "equilateral triangle" counts for "triangle") or the last \\boxed{} holds it."""
    truth = truth_text(ground_truth, "spatial").strip().lower()
    if response.strip().lower() == truth:
        return 1.0
    for span in [span.strip().lower() for span in _BOLD_NO_STARS.findall(response)[-3:]]:
        if span == truth or _DIGIT_WORDS.get(truth) == span:
            return 1.0
        if truth in _SHAPES and truth in span and len(span) < 2 * len(truth) + 5:
            return 1.0  # "two tetrahedra" for "tetrahedra", but not "circle, square, triangle" for "triangle"
    boxed = boxed_text(response)
    return float(boxed is not None and boxed.lower() == truth)


def _zebra_single(response: str, truth: str) -> float:
    """The last ***word***, else the last word of the response, equal to the truth (a digit may stand for its
    word, and "horror" answers "horror movies")."""
    bold = _TRIPLE_BOLD_WORD.findall(response)
    words = bold or _WORD.findall(response)
    if not words:
        return 0.0
    answer, wanted = words[-1].lower(), truth.strip().lower()
    return float(wanted in (answer, _DIGIT_WORDS.get(answer), f"{answer} movies"))


def _zebra_cells(response: str, truth: str) -> float:
    """Cells from the <solution> tags (several are read as one list, its last cells kept), else \\boxed{}, else
    a last line with as many cells as the truth; a cell is right when it holds the truth's cell as a word."""
    wanted = [cell.strip().lower().replace("-", " ") for cell in truth.split(",")]
    tagged = solution_tags(response)
    if tagged:
        cells = [cell for text in tagged for cell in text.split(",")][-len(wanted):]
    elif (boxed := boxed_text(response)) is not None:
        cells = boxed.split(",")
    else:
        last_line = response.strip().split("\n")[-1]
        cells = last_line.split(",") if last_line.count(",") == len(wanted) - 1 else []
    if not cells:
        return 0.0
    right = sum(_cell_holds(cell, want) for cell, want in zip(cells, wanted))
    return _all_and_fraction(right, len(wanted))


def _cell_holds(cell: str, wanted: str) -> bool:
    given = " ".join(cell.strip().lower().replace("-", " ").replace("position", "").split())
    return given == wanted or re.search(rf"(?<!\w){re.escape(wanted)}(?!\w)", given) is not None


def _verdicts(truth: str, task: str) -> list[str]:
    verdicts = [_clean_cell(cell) for cell in truth.split(",")]
    if not verdicts or any(v not in ("yes", "no", "unknown") for v in verdicts):
        raise ValueError(f"livebench {task}: ground truth must be comma-separated yes/no/unknown, got {truth!r}")
    return verdicts


def _clean_cell(cell: str) -> str:
    return cell.strip().strip("*.").strip().lower()


def _boxed_with_bold(response: str) -> str | None:
    """\\boxed{} content, \\textbf{} counting as a box (LiveBench reads both)."""
    return boxed_text(response.replace("\\textbf{", "\\boxed{"))


def _last_verdict_triple(response: str) -> str | None:
    matches = list(_VERDICT_TRIPLE.finditer(response.lower()))
    return ", ".join(matches[-1].groups()) if matches else None


def _nonempty(text: str | None) -> str | None:
    return text if text is not None and text.strip() else None


def _all_and_fraction(right: int, total: int) -> float:
    return ((right == total) + right / total) / 2
