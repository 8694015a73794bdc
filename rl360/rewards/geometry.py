"""`hiyouga/geometry3k`: verl's geo3k reward, 0.9 x accuracy + 0.1 x format.

- accuracy (`acc`, 0 or 1): the last \\boxed{} after any </think> equals the ground truth by math-verify
  (verl uses mathruler's grader; math-verify accepts the same equivalent forms, e.g. `8\\sqrt{3}` for
  `8 \\sqrt { 3 }`).
- format (`format`, 0 or 1): the response (leading whitespace aside) opens with `<think>`, closes it with
  `</think>`, and a \\boxed{} follows the `</think>` (verl's `<think>.*</think>.*\\boxed{.*}.*`).

So a right answer in the right format scores 1.0, a right answer without the format 0.9, a wrong one in the
right format 0.1. The ground truth is the answer text as Geometry3K stores it ("3", "\\frac{2}{3}", "8 \\sqrt { 3 }").
"""

from __future__ import annotations

from rl360.rewards.math import last_boxed, math_score
from rl360.rewards.registry import register_reward

ACCURACY_WEIGHT = 0.9
FORMAT_WEIGHT = 0.1


@register_reward("hiyouga/geometry3k", exact=True,
                 truth="the answer as LaTeX or plain text, e.g. \"3\", \"\\frac{2}{3}\", \"8 \\sqrt { 3 }\"",
                 answer="0.9 x (last \\boxed{} equals the truth by math-verify, reported as acc) + "
                        "0.1 x (<think>...</think> then a \\boxed{})")
def geometry3k_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """0.9 x accuracy + 0.1 x format (see the module doc), with `acc` and `format` reported."""
    accuracy = math_score(solution_str, ground_truth)
    fmt = think_then_boxed(solution_str)
    return {"score": ACCURACY_WEIGHT * accuracy["score"] + FORMAT_WEIGHT * fmt, "acc": accuracy["score"],
            "format": fmt, "pred": accuracy["pred"]}


def think_then_boxed(response: str) -> float:
    """1.0 when the response starts with `<think>`, closes it, and has a complete \\boxed{} after the
    `</think>`; else 0.0."""
    text = response.lstrip()
    if not text.startswith("<think>") or "</think>" not in text:
        return 0.0
    after = text.split("</think>", 1)[1]
    return 1.0 if last_boxed(after) is not None and "\\boxed" in after else 0.0
