"""`table__*` (FinQA, HiTab, MultiHiertt): the last \\boxed{} after any </think> against the ground truth.

Answers separated by "|" are a list (HiTab's truths join several cells so), compared as a multiset: the
same number of answers, each matching a different one of the truth's, in any order. Two answers match when

- both read as numbers ("1,234.5", "$3", "-$3", "12%", "\\$3", "12\\%", LaTeX text wrappers and spaces
  aside) within `RELATIVE_TOLERANCE` (1e-4) relative or 1e-6 absolute; a percentage also matches its
  fraction (truth "14.1%" accepts 14.1% / 14.1 / 0.141, as FinQA's answers and computed values differ),
  but a plain number never matches a hundredth of itself ("14.1" vs "0.141");
- or their texts are equal case-, space- and punctuation-insensitively ("\\text{Paris}" ~ "paris.");
- or, for LaTeX such as "\\frac{1}{2}", the math checker (`rl360.rewards.math.is_equiv`) says so.

`extra_info["rel_tol"]` overrides the tolerance for a row.

FinQA (`table__finqa*` only): Reasoning360's FinQA preprocessing stores each answer as a number, a
percentage divided by 100 ("14.1%" becomes 0.141), and its scorer (prime_math's `math_equal`) accepts an
answer equal to the truth, 100 times it or a hundredth of it on every table row. Here, only on FinQA rows
and only when the truth is a plain number (no "%") with 0 < |truth| < 1, a plain-number answer also matches
100 times the truth: 14.1 and 14.1% both match 0.141 (the latter by the percentage rule above), and 0.141
still does. Why this bound: FinQA's percentage answers (shares, changes, rates) are almost all below 100%,
so their stored fractions lie below 1 in magnitude, while FinQA truths of 1 or more are amounts (millions,
dollars, counts) for which 100 times is simply wrong; FinQA's own evaluation compares the executed program's
value, in which a percentage is such a fraction, with the gold value, so both spellings are the same answer
there. What the bound cannot tell apart: a FinQA amount below 1 (a per-share figure of 0.45) also accepts 45;
a percentage of 100% or more stored as a fraction (1.5 for "150%") accepts only 1.5 and 150%. No other table
row accepts 100 times its truth.
"""

from __future__ import annotations

from rl360.rewards.extract import as_number, normalize_text, numbers_close, unwrap_latex
from rl360.rewards.math import TIMEOUT_S, MathTimeout, is_equiv, last_boxed, strip_thinking, time_limit
from rl360.rewards.registry import register_reward

RELATIVE_TOLERANCE = 1e-4
_LATEX_HINTS = ("\\", "^", "/")


def answers_match(pred: str, truth: str, rel: float = RELATIVE_TOLERANCE, fraction_truths: bool = False) -> bool:
    """Whether one answer matches one truth (see the module doc); `fraction_truths` applies FinQA's rule
    (a plain truth 0 < |x| < 1 also accepts 100x, as a percentage written without its "%")."""
    x, y = as_number(pred), as_number(truth)
    if x is not None and y is not None:
        pred_percent, truth_percent = "%" in unwrap_latex(pred), "%" in unwrap_latex(truth)
        candidates = {x}
        if pred_percent and not truth_percent:
            candidates.add(x / 100)  # 14.1% for 0.141
        elif truth_percent and not pred_percent:
            candidates.add(x * 100)  # 0.141 for 14.1%
        elif fraction_truths and not truth_percent and 0 < abs(y) < 1:
            candidates.add(x / 100)  # 14.1 for FinQA's 0.141 (stored from "14.1%")
        return any(numbers_close(c, y, rel) for c in candidates)
    if normalize_text(pred) == normalize_text(truth):
        return True
    return any(hint in pred + truth for hint in _LATEX_HINTS) and _math_equal(pred, truth)


def _math_equal(pred: str, truth: str) -> bool:
    try:
        with time_limit(TIMEOUT_S):
            return is_equiv(pred, truth)
    except MathTimeout:
        return False


@register_reward("table", truth="the answer text, several joined by \"|\" (HiTab)",
                 answer="the last \\boxed{} after any </think>: numbers within 1e-4, \"|\" lists in any order")
def table_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """1.0 when the boxed answers match the truth's answers one to one (see the module doc)."""
    return _score_boxed(solution_str, ground_truth, extra_info, fraction_truths=False)


@register_reward("table__finqa", truth="the answer, e.g. \"14.1%\", or Reasoning360's number (0.141 for 14.1%)",
                 answer="as `table`; a plain truth with 0 < |x| < 1 also accepts 100x (14.1 or 14.1% for 0.141)")
def finqa_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """`table_score`, where a truth 0 < |x| < 1 also accepts 100x (FinQA's percentages stored as fractions;
    see the module doc)."""
    return _score_boxed(solution_str, ground_truth, extra_info, fraction_truths=True)


def _score_boxed(solution_str: str, ground_truth, extra_info: dict | None, fraction_truths: bool) -> dict:
    rel = float((extra_info or {}).get("rel_tol") or RELATIVE_TOLERANCE)
    pred = last_boxed(strip_thinking(solution_str))
    if pred is None or not pred.strip():
        return {"score": 0.0, "pred": pred}
    wanted = [part.strip() for part in str(ground_truth).split("|") if part.strip()]
    if not wanted:
        raise ValueError(f"table: empty ground truth {ground_truth!r}")
    given = [part.strip() for part in pred.split("|") if part.strip()]
    return {"score": float(_one_to_one(given, wanted, rel, fraction_truths)), "pred": pred}


def _one_to_one(given: list[str], wanted: list[str], rel: float, fraction_truths: bool) -> bool:
    """Whether each given answer matches a different wanted one and none is left over (a bipartite
    matching, so an answer that could match two truths takes whichever leaves the others matchable)."""
    if len(given) != len(wanted):
        return False
    options = [[j for j, truth in enumerate(wanted) if answers_match(answer, truth, rel, fraction_truths)]
               for answer in given]
    owner = [-1] * len(wanted)  # owner[j]: the given answer matched to wanted[j]

    def assign(i: int, seen: set[int]) -> bool:
        for j in options[i]:
            if j not in seen:
                seen.add(j)
                if owner[j] < 0 or assign(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    return all(assign(i, set()) for i in range(len(given)))
