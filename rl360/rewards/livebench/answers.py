"""Pulling LiveBench answers out of responses: <solution> tags, bold spans, \\boxed{}, and the row's fields.

LiveBench's prompts ask for answers in one of these wrappers; each task's scorer picks the ones its prompt
asks for, in LiveBench's order of preference.
"""

from __future__ import annotations

import re

from rl360.rewards.extract import unwrap_latex
from rl360.rewards.math import last_boxed

NEW_FORMAT_DATE = "2024-11-25"  # zebra_puzzle and connections questions released from then on use <solution>
# A closing tag written as the opener ("</solution>x</solution>") is read too, as LiveBench reads it.
_SOLUTION = re.compile(r"</?solution>(.*?)</solution>", re.DOTALL | re.IGNORECASE)
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}")


def solution_tags(text: str) -> list[str]:
    """Contents of every <solution> … </solution> in `text`, in order."""
    return [match.group(1) for match in _SOLUTION.finditer(text)]


def last_solution(text: str) -> str | None:
    """Content of the last <solution> … </solution>, or None."""
    found = solution_tags(text)
    return found[-1] if found else None


def boxed_text(text: str) -> str | None:
    """Content of the last \\boxed{} or \\fbox{} with \\text{}-style wrappers and backslashes removed, or None."""
    boxed = last_boxed(text)
    if boxed is None:
        return None
    return unwrap_latex(boxed).replace("\\", "").strip()


def truth_text(ground_truth, task: str) -> str:
    """The ground truth of a text-answer task; `ValueError` naming the task when it is not a non-empty string."""
    if not isinstance(ground_truth, str) or not ground_truth.strip():
        raise ValueError(f"livebench {task}: ground truth must be a non-empty string, got {ground_truth!r}")
    return ground_truth


def release_date(extra_info: dict) -> str | None:
    """The question's LiveBench release date as "YYYY-MM-DD" from `extra_info["date"]` (Reasoning360 stores it
    there; `livebench_release_date` is read too), or None when absent; `ValueError` when it is not a date."""
    for key in ("date", "livebench_release_date"):
        value = extra_info.get(key)
        if value is None:
            continue
        if hasattr(value, "strftime"):  # datetime, date, pandas Timestamp
            return value.strftime("%Y-%m-%d")
        text = str(value)  # "2024-06-24", "2024-06-24 00:00:00", numpy datetime64
        if _DATE.match(text):
            return text[:10]
        raise ValueError(f"livebench: extra_info[{key!r}] is not a date: {value!r}")
    return None


def prompt_text(extra_info: dict, task: str) -> str:
    """The question text from `extra_info["prompt"]`: a string, a list of turns (Reasoning360 stores LiveBench's
    `turns` there), or chat messages with "content"; `ValueError` naming the key when it is missing."""
    prompt = extra_info.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if prompt is None or not hasattr(prompt, "__iter__"):
        raise ValueError(f"livebench {task}: needs the question text in extra_info['prompt'], got {prompt!r}")
    parts = [turn.get("content", "") if isinstance(turn, dict) else str(turn) for turn in prompt]
    if not any(parts):
        raise ValueError(f"livebench {task}: extra_info['prompt'] holds no question text: {prompt!r}")
    return "\n".join(parts)
