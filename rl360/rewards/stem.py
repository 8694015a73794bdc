"""`stem__*`: multiple choice when the ground truth is one letter A-J (GPQA), else the math checker
(WebInstruct).

Multiple choice: the chosen letter is read, after any </think>, from the last \\boxed{} (\\boxed{B},
\\boxed{(B)}, \\boxed{\\text{B}}, \\boxed{B. 42 kg}); without a box, from the last "Answer: B" / "the answer
is (B)"; else from a "(B)" that ends the response. Letters are capitals (so "the answer is a photon" names
no choice), and a box that names anything but one letter ("A or B", "A, C") scores 0: one letter only.
Free-form answers go through `rl360.rewards.math.math_score`.
"""

from __future__ import annotations

import re

from rl360.rewards.extract import unwrap_latex
from rl360.rewards.math import last_boxed, math_score, strip_thinking
from rl360.rewards.registry import register_reward

_TRUTH_LETTER = re.compile(r"\(?([A-J])\)?")
_LONE_LETTER = re.compile(r"\(?([A-J])\)?[.:]?")
_LABELLED = re.compile(r"(?:\(([A-J])\)|([A-J])[.:)])\s+(.+)", re.DOTALL)  # "B. 42 kg", "(B) photon"
_ANOTHER = re.compile(r"\([A-J]\)|^(?:or|and|,)(?![A-Za-z])", re.IGNORECASE)
_STATED = re.compile(r"(?i:answer)(?:\s+is)?\s*:?\s*(?:\*\*)?\s*(?:\(([A-J])\)|([A-J])(?=\s*(?:[.,;!*)]|$)))",
                     re.MULTILINE)
_CLOSING = re.compile(r"\(([A-J])\)[\s.*]*$")


def chosen_letter(response: str) -> str | None:
    """The multiple-choice letter a response commits to, or None (see the module doc)."""
    text = strip_thinking(response)
    boxed = last_boxed(text)
    if boxed is not None:
        return _boxed_letter(boxed)
    stated = list(_STATED.finditer(text))
    if stated:
        return stated[-1].group(1) or stated[-1].group(2)
    closing = _CLOSING.search(text)
    return closing.group(1) if closing else None


def _boxed_letter(content: str) -> str | None:
    """The one letter a box names ("B", "(B)", "B.", "B. 42 kg", "(B) photon"), or None ("A or B")."""
    text = unwrap_latex(content).replace("**", "").strip()
    lone = _LONE_LETTER.fullmatch(text)
    if lone:
        return lone.group(1)
    labelled = _LABELLED.fullmatch(text)
    if labelled and not _ANOTHER.search(labelled.group(3)):
        return labelled.group(1) or labelled.group(2)
    return None


@register_reward("stem")
def stem_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """Multiple-choice letter or math-checked answer (see the module doc)."""
    truth = str(ground_truth).strip()
    if not truth:
        raise ValueError(f"stem: empty ground truth {ground_truth!r}")
    letter_truth = _TRUTH_LETTER.fullmatch(truth)
    if letter_truth:
        letter = chosen_letter(solution_str)
        return {"score": float(letter == letter_truth.group(1)), "pred": letter}
    return math_score(solution_str, truth, extra_info)
