"""`openai/gsm8k`: the number after the last "#### " of the response, or its last \\boxed{} number.

verl's GSM8K reward reads only the strict "#### N" form (the format of GSM8K's own solutions) and compares
the text exactly. Here the response's answer is, after any </think>, whichever comes last of
- "#### N" (N a number, with optional sign, thousands commas and a leading `$`), and
- a \\boxed{} holding one number (LaTeX text wrappers, `\\$`, `$`, commas and a trailing `.` or `%` dropped),
and it matches when it equals the ground truth as a number (so "1,200", "1200.0" and "$1200" match "1200").

The ground truth is the number as verl's preprocessing stores it ("72"); a full GSM8K solution ending in
"#### 72" is reduced to the number after its last "####". A ground truth that holds no number is a bad row
(`ValueError`).
"""

from __future__ import annotations

import re
from fractions import Fraction

from rl360.rewards.extract import unwrap_latex
from rl360.rewards.math import last_boxed, strip_thinking
from rl360.rewards.registry import register_reward

_HASHES = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+)")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")


@register_reward("openai/gsm8k", exact=True,
                 truth="the answer number as a string, e.g. \"72\" (a solution ending in \"#### 72\" is cut to 72)",
                 answer="the number after the last \"#### \" or in the last \\boxed{}, whichever is later, "
                        "compared as a number")
def gsm8k_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """1.0 when the response's final number (see the module doc) equals the ground truth's, else 0.0."""
    truth = truth_number(ground_truth)
    pred = final_number(solution_str)
    return {"score": float(pred is not None and pred == truth), "pred": None if pred is None else str(pred)}


def truth_number(ground_truth) -> Fraction:
    """The ground truth as an exact number; `ValueError` naming it when it holds none."""
    text = str(ground_truth).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip()
    value = as_exact_number(text)
    if value is None:
        raise ValueError(f"openai/gsm8k: ground truth must be a number (or end in '#### N'), got {text[:80]!r}")
    return value


def final_number(response: str) -> Fraction | None:
    """The response's final answer as an exact number: the later of its last "#### N" and its last
    \\boxed{} (when that holds one number); None when there is neither."""
    text = strip_thinking(response)
    hashes = list(_HASHES.finditer(text))
    box_at = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if hashes and hashes[-1].start() > box_at:
        return as_exact_number(hashes[-1].group(1))
    boxed = last_boxed(text) if box_at >= 0 else None
    if boxed is not None:
        return as_exact_number(boxed)
    return as_exact_number(hashes[-1].group(1)) if hashes else None


def as_exact_number(text: str) -> Fraction | None:
    """`text` as an exact number once LaTeX wrappers, currency signs, thousands commas, spaces, and a
    trailing period or percent sign are dropped; None when what is left is not one number."""
    cleaned = unwrap_latex(text).replace("$", "").replace(",", "").replace(" ", "").rstrip(".%")
    if not _NUMBER.fullmatch(cleaned):
        return None
    return Fraction(cleaned)
