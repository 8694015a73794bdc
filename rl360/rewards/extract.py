"""Pulling answers out of responses, and comparing answer values; shared by the reward domains."""

from __future__ import annotations

import ast
import json
import math
import re

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


def after_thinking(text: str) -> str:
    """The text after the last </think>, or all of it."""
    return text.rsplit("</think>", 1)[-1]


def last_answer_tag(text: str) -> str | None:
    """Content of the last <answer> … </answer> after any </think>, stripped; None when there is none."""
    found = _ANSWER_TAG.findall(after_thinking(text))
    return found[-1].strip() if found else None


def parse_literal(text: str):
    """A JSON value or a Python literal from `text`; `ValueError` naming the text when it is neither."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise ValueError(f"not a JSON value or Python literal: {text[:120]!r}") from None


def parse_truth(ground_truth, domain: str):
    """The ground truth as a value (JSON text, a Python literal, or already a value); `ValueError` naming the
    domain and the value when it cannot be read (a bad dataset row, not a bad response)."""
    if not isinstance(ground_truth, str):
        return ground_truth
    try:
        return parse_literal(ground_truth)
    except ValueError:
        raise ValueError(f"{domain}: ground truth is not JSON or a Python literal: {ground_truth[:120]!r}") from None


def last_json_value(text: str, opener: str = "{"):
    """The last JSON object (opener "{") or array ("[") in `text` that parses, or None."""
    closer = "}" if opener == "{" else "]"
    end = len(text)
    while True:
        end = text.rfind(closer, 0, end)
        if end < 0:
            return None
        start = text.rfind(opener, 0, end)
        while start >= 0:
            try:
                return json.loads(text[start:end + 1])
            except ValueError:
                start = text.rfind(opener, 0, start)
        end -= 1


def normalize_text(value) -> str:
    """Case-, space- and trailing-punctuation-insensitive text of a value."""
    text = " ".join(str(value).strip().lower().split())
    return text.strip(" .;:!")


def as_number(value) -> float | None:
    """A number from 3, "3.5", "1,234", "$12", "-4.5%" (percent kept as written: 45% -> 45); else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value).strip().replace(",", "").replace("$", "").replace("\\%", "%").rstrip("%").strip()
    return float(text) if _NUMBER.match(text) else None


def numbers_close(a: float, b: float, rel: float = 1e-4, abs_tol: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_tol)


def values_equal(a, b, rel: float = 1e-4) -> bool:
    """Structural equality of parsed values: numbers within `rel`, strings normalised, lists in order,
    dicts by key."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k], rel) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(values_equal(x, y, rel) for x, y in zip(a, b))
    x, y = as_number(a), as_number(b)
    if x is not None and y is not None and not isinstance(a, str) and not isinstance(b, str):
        return numbers_close(x, y, rel)
    return normalize_text(a) == normalize_text(b) if isinstance(a, str) and isinstance(b, str) else a == b
