"""Pulling answers out of responses, and comparing answer values; shared by the reward domains.

Model text is only ever parsed (`json`, `ast.literal_eval`), never evaluated.
"""

from __future__ import annotations

import ast
import json
import math
import re

from rl360.rewards.math import strip_thinking

MAX_PARSE_CHARS = 100_000  # longer answer texts are not parsed (literal_eval's cost grows with nesting)
MAX_SCAN_CHARS = 20_000  # a JSON answer is looked for in this many last characters of the response
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(,\d{3})+(\.\d*)?$")
_FENCE = re.compile(r"^```[A-Za-z0-9_+-]*[ \t]*\n?(.*?)\n?```$", re.DOTALL)
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|emph)\s*\{([^{}]*)\}")
_CURRENCY = "$€£¥"


def last_answer_tag(text: str) -> str | None:
    """Content of the last <answer> … </answer> after any </think>, stripped; None when there is none or the
    last <answer> is never closed."""
    text = strip_thinking(text)
    found = list(_ANSWER_TAG.finditer(text))
    if not found or "<answer>" in text[found[-1].end():].lower():
        return None
    return found[-1].group(1).strip()


def strip_fence(text: str) -> str:
    """`text` stripped, without a markdown code fence (```json … ```) or backticks around all of it."""
    text = text.strip()
    fenced = _FENCE.match(text)
    return fenced.group(1).strip() if fenced else text.strip("`").strip()


def parse_literal(text: str):
    """A JSON value or a Python literal from `text` (a markdown code fence around it is dropped);
    `ValueError` naming the text when it is neither."""
    stripped = strip_fence(text)
    if len(stripped) > MAX_PARSE_CHARS:
        raise ValueError(f"value of {len(stripped)} characters is too long to parse")
    try:
        return json.loads(stripped)
    except ValueError:
        pass
    try:
        return ast.literal_eval(stripped)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise ValueError(f"not a JSON value or Python literal: {text[:120]!r}") from None


def parse_truth(ground_truth, domain: str):
    """The ground truth as a value (JSON text, a Python literal, or already a value); `ValueError` naming the
    domain and the value when it cannot be read (a bad dataset row, not a bad response). A numpy array (a
    parquet list column as pandas reads it) comes back as a list."""
    if not isinstance(ground_truth, str):
        return ground_truth.tolist() if hasattr(ground_truth, "tolist") else ground_truth
    try:
        return parse_literal(ground_truth)
    except ValueError:
        raise ValueError(f"{domain}: ground truth is not JSON or a Python literal: {ground_truth[:120]!r}") from None


def last_json_object(text: str) -> dict | None:
    """The last JSON object in the last `MAX_SCAN_CHARS` characters of `text` (objects nested in an earlier
    one are skipped), or a Python dict literal (single quotes, True/None) after it; None when there is none.

    One forward pass: at each "{" the decoder either reads an object and the scan jumps past it, or fails
    at the first character that is not JSON.
    """
    tail = text[-MAX_SCAN_CHARS:]
    decoder = json.JSONDecoder()
    found, found_end, pos = None, 0, 0
    while (start := tail.find("{", pos)) >= 0:
        try:
            value, end = decoder.raw_decode(tail, start)
        except (ValueError, RecursionError):
            pos = start + 1
            continue
        if isinstance(value, dict):
            found, found_end = value, end
        pos = end
    later = _last_dict_literal(tail[found_end:]) if "}" in tail[found_end:] else None
    return later if later is not None else found


def _last_dict_literal(text: str):
    """The Python dict literal that ends at the last "}" of `text`, or None (braces matched by counting)."""
    end = text.rfind("}")
    depth, start = 0, end
    while start >= 0:
        depth += {"}": 1, "{": -1}.get(text[start], 0)
        if depth == 0:
            break
        start -= 1
    if start < 0 or end - start > MAX_PARSE_CHARS:
        return None
    try:
        value = ast.literal_eval(text[start:end + 1])
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def unwrap_latex(text: str) -> str:
    r"""`text` with \text{…}-style wrappers replaced by their content, \$ \% as $ %, LaTeX spaces (\, \;
    \! ~) dropped and a Unicode minus as "-"."""
    previous = None
    while previous != text:  # wrappers may nest: \textbf{\text{x}}
        previous, text = text, _TEXT_WRAPPER.sub(r"\1", text)
    for latex, plain in (("\\$", "$"), ("\\%", "%"), ("\\,", ""), ("\\;", ""), ("\\!", ""), ("~", " "),
                         ("\u2212", "-")):
        text = text.replace(latex, plain)
    return text.strip()


def normalize_text(value) -> str:
    """Text of a value compared case-, space-, quote- and trailing-punctuation-insensitively, LaTeX text
    wrappers removed."""
    text = " ".join(unwrap_latex(str(value)).lower().split())
    return text.strip(" .;:!*\"'`")


def as_number(value) -> float | None:
    """A number from 3, "3.5", "1,234.5", "$12", "-$3", "4.5%", "\\$3", "12\\%" (a percentage as written:
    "45%" -> 45.0); None for anything else, e.g. "1,2" (not thousands groups) or "3 apples"."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    text = unwrap_latex(str(value)).replace(" ", "")
    sign = ""
    if text and text[0] in "+-":
        sign, text = text[0], text[1:]
    text = text.lstrip(_CURRENCY)
    text = sign + text.rstrip("%")
    if "," in text:
        if not _THOUSANDS.match(text):
            return None
        text = text.replace(",", "")
    return float(text) if _NUMBER.match(text) else None


def numbers_close(a: float, b: float, rel: float = 1e-4, abs_tol: float = 1e-6) -> bool:
    """`a` and `b` within `rel` (relative) or `abs_tol` (absolute)."""
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_tol)


def values_equal(a, b, rel: float = 1e-6) -> bool:
    """Equality of parsed JSON / literal values: numbers within `rel` relative (1e-9 absolute), booleans
    only with booleans, strings exactly (outer whitespace aside), lists and tuples in order, dicts by key."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k], rel) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(values_equal(x, y, rel) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return numbers_close(a, b, rel, 1e-9)
    if isinstance(a, str) and isinstance(b, str):
        return a.strip() == b.strip()
    return a == b
