"""DeepScaleR-Preview (agentica-org/DeepScaleR-Preview-Dataset) -> math__deepscaler.

Source fields: `problem`, `answer` (a string; a list keeps its first entry), `solution` (unused). The prompt is
the problem followed by the \\boxed{} instruction; the ground truth is the answer.

    python -m data_preprocess.math.deepscaler --input deepscaler.json --out data
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from data_preprocess.common import BOXED, Example, RecordError, require, run_script, user_prompt


def first_answer(answer: Any) -> str:
    """The answer as a string; of a list of answers, the first."""
    if isinstance(answer, list):
        if not answer:
            raise RecordError("field 'answer' is an empty list")
        answer = answer[0]
    text = str(answer).strip()
    if not text:
        raise RecordError("field 'answer' is empty")
    return text


def convert(record: dict[str, Any], index: int, args: argparse.Namespace) -> Example:
    problem, answer = require(record, "problem", "answer")
    return Example(user_prompt(f"{problem.strip()} {BOXED}"), first_answer(answer))


def main(argv: list[str] | None = None) -> Path:
    return run_script(convert, domain="math", name="deepscaler", description=__doc__, argv=argv)


if __name__ == "__main__":
    main()
