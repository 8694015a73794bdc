"""LiveBench's data-analysis tasks: cta (column type annotation), tablejoin, tablereformat.

Each scorer takes the response (thinking already stripped), the ground truth and the row's extra_info,
and returns a score in [0, 1]. Model text is only parsed (`json`, `ast.literal_eval`), never run.
"""

from __future__ import annotations

import re

from rl360.rewards.extract import parse_literal, parse_truth
from rl360.rewards.livebench.answers import boxed_text, last_solution, prompt_text, truth_text
from rl360.rewards.livebench.tables import FORMATS, read_table, rows_from_header, tables_equal
from rl360.rewards.math import last_boxed

_NON_WORD = re.compile(r"\W")
_FENCE = re.compile(r"```[^\n`]*\n?(.*?)```", re.DOTALL)
_QUOTED_TEXT = re.compile(r"\\text\{['\"](.*?)['\"]\}")
_FORMAT_V1 = re.compile(r"convert the Input Table from (\w+) format to (\w+) format", re.IGNORECASE)
_FORMAT_V2 = re.compile(r"Target Format:\s*(\w+)", re.IGNORECASE)
_INTRO = re.compile(r"^\s*(?:here|input)\b[^\n]*?\b(?:format|table)\s*[:)]\s*", re.IGNORECASE)


def cta_score(response: str, ground_truth, extra_info: dict) -> float:
    """A column's class name ("sample_date"); the last \\boxed{} if any, else the whole response, compared
    lower-cased without non-word characters: 1.0 when equal or when the answer ends with the class."""
    wanted = _word_chars(truth_text(ground_truth, "cta"))
    boxed = boxed_text(response) if "\\boxed{" in response else None
    answer = _word_chars(boxed if boxed is not None else response)
    return float(bool(wanted) and answer.endswith(wanted))


def tablejoin_score(response: str, ground_truth, extra_info: dict) -> float:
    """A join mapping {column of table A: column of table B} (a dict or its literal); the answer is a dict from
    <solution>, a code fence, \\boxed{} or the whole response. F1 of its pairs against the truth's, rounded to
    2 places (a pair with the wrong B column is a false positive and a false negative; null values dropped)."""
    wanted = parse_truth(ground_truth, "livebench tablejoin")
    if not isinstance(wanted, dict):
        raise ValueError(f"livebench tablejoin: ground truth must be a dict, got {ground_truth!r}")
    given = _join_mapping(response)
    if not given:
        return 0.0
    true_pos = sum(1 for key, value in given.items() if wanted.get(key) and wanted[key] == value)
    false_pos = len(given) - true_pos
    false_neg = sum(1 for key, value in given.items() if wanted.get(key) and wanted[key] != value)
    false_neg += sum(1 for key in wanted if not given.get(key))
    return round(2 * true_pos / (2 * true_pos + false_pos + false_neg), 2)


def tablereformat_score(response: str, ground_truth, extra_info: dict) -> float:
    """A table converted to the format the question names (csv, tsv, json, jsonl, html, markdown; read from
    `extra_info["prompt"]`); the answer is the last <solution> or code fence, else the response without an
    opening "Here is the table:"; 1.0 when it holds the truth's table (see `tables.tables_equal`), else 0.0."""
    truth = truth_text(ground_truth, "tablereformat")
    fmt = _target_format(prompt_text(extra_info, "tablereformat"))
    wanted = read_table(truth, fmt)
    if wanted is None:
        raise ValueError(f"livebench tablereformat: ground truth is not a {fmt} table: {truth[:200]!r}")
    answer = _table_answer(response, fmt)
    candidates = [read_table(answer, fmt)]
    if fmt in ("csv", "tsv"):  # words before or after the table
        candidates.append(rows_from_header(answer, truth.strip().split("\n")[0], fmt))
    return float(any(table is not None and tables_equal(table, wanted) for table in candidates))


def _word_chars(text: str) -> str:
    return _NON_WORD.sub("", text.lower().strip())


def _join_mapping(response: str) -> dict:
    """The answer's mapping with null values dropped; {} when none can be read."""
    text = last_solution(response)
    text = text.strip() if text is not None else response
    candidates = [text]
    flat = text.replace("\n", "")
    fences = _FENCE.findall(flat)
    if fences:
        candidates.append(fences[-1])
    elif "\\boxed" in flat and (boxed := last_boxed(flat)) is not None:
        candidates.append(_QUOTED_TEXT.sub(r"'\1'", boxed).replace("\\", ""))
    for candidate in candidates:
        try:
            value = parse_literal(candidate)
        except ValueError:
            continue
        if isinstance(value, dict):
            return {key: item for key, item in value.items() if item is not None}
        return {}
    return {}


def _target_format(prompt: str) -> str:
    found = _FORMAT_V1.search(prompt)
    fmt = found.group(2) if found else None
    if fmt is None:
        targets = _FORMAT_V2.findall(prompt)
        fmt = targets[-1] if targets else None
    if fmt is None:
        raise ValueError("livebench tablereformat: extra_info['prompt'] names no target format "
                         f"('... from X format to Y format' or 'Target Format: Y'): {prompt[:200]!r}")
    if fmt.lower() not in FORMATS:
        raise ValueError(f"livebench tablereformat: unknown target format {fmt!r}; known: {list(FORMATS)}")
    return fmt.lower()


def _table_answer(response: str, fmt: str) -> str:
    text = last_solution(response)
    text = text.strip() if text is not None else response
    fences = _FENCE.findall(text)
    if fences:
        text = fences[-1]
    else:
        text = "\n".join(line for line in text.split("\n") if not line.strip().startswith("```"))
    if fmt != "html":
        text = text.replace("&amp;", "&")
    return _INTRO.sub("", text.strip(), count=1).strip()
