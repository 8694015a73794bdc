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
"""

from __future__ import annotations

from rl360.rewards.extract import as_number, normalize_text, numbers_close, unwrap_latex
from rl360.rewards.math import TIMEOUT_S, MathTimeout, is_equiv, last_boxed, strip_thinking, time_limit
from rl360.rewards.registry import register_reward

RELATIVE_TOLERANCE = 1e-4
_LATEX_HINTS = ("\\", "^", "/")


def answers_match(pred: str, truth: str, rel: float = RELATIVE_TOLERANCE) -> bool:
    """Whether one answer matches one truth (see the module doc)."""
    x, y = as_number(pred), as_number(truth)
    if x is not None and y is not None:
        pred_percent, truth_percent = "%" in unwrap_latex(pred), "%" in unwrap_latex(truth)
        candidates = {x}
        if pred_percent and not truth_percent:
            candidates.add(x / 100)  # 14.1% for 0.141
        elif truth_percent and not pred_percent:
            candidates.add(x * 100)  # 0.141 for 14.1%
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


@register_reward("table")
def table_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """1.0 when the boxed answers match the truth's answers one to one (see the module doc)."""
    rel = float((extra_info or {}).get("rel_tol") or RELATIVE_TOLERANCE)
    pred = last_boxed(strip_thinking(solution_str))
    if pred is None or not pred.strip():
        return {"score": 0.0, "pred": pred}
    wanted = [part.strip() for part in str(ground_truth).split("|") if part.strip()]
    if not wanted:
        raise ValueError(f"table: empty ground truth {ground_truth!r}")
    given = [part.strip() for part in pred.split("|") if part.strip()]
    return {"score": float(_one_to_one(given, wanted, rel)), "pred": pred}


def _one_to_one(given: list[str], wanted: list[str], rel: float) -> bool:
    """Whether each given answer matches a different wanted one and none is left over (a bipartite
    matching, so an answer that could match two truths takes whichever leaves the others matchable)."""
    if len(given) != len(wanted):
        return False
    options = [[j for j, truth in enumerate(wanted) if answers_match(answer, truth, rel)] for answer in given]
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
