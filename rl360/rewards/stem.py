"""`stem__*`: multiple choice when the ground truth is one letter (GPQA), else the math checker (WebInstruct).

Multiple choice: the chosen letter is read from the last \\boxed{} after any </think> (\\boxed{B},
\\boxed{(B)}, \\boxed{B. text}), else from a closing "Answer: B" / "answer is (B)"; a response naming no
single letter scores 0. Free-form answers go through `rl360.rewards.math.math_score`.
"""

from __future__ import annotations

import re

from rl360.rewards.math import last_boxed, math_score, strip_thinking
from rl360.rewards.registry import register_reward

_LETTER = re.compile(r"^\(?([A-J])\)?(?:[.:)]|\s|$)")
_STATED = re.compile(r"answer\s*(?:is|:)?\s*:?\s*\(?([A-J])\)?(?![A-Za-z])", re.IGNORECASE)


def chosen_letter(response: str) -> str | None:
    """The multiple-choice letter a response commits to, or None."""
    text = strip_thinking(response)
    boxed = last_boxed(text)
    if boxed is not None:
        found = _LETTER.match(boxed.strip().replace("\\text{", "").rstrip("}"))
        return found.group(1) if found else None
    stated = _STATED.findall(text)
    return stated[-1].upper() if stated else None


@register_reward("stem")
def stem_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    truth = str(ground_truth).strip()
    if re.fullmatch(r"\(?[A-J]\)?", truth):
        letter = chosen_letter(solution_str)
        return {"score": float(letter == truth.strip("()")), "pred": letter}
    return math_score(solution_str, truth, extra_info)
