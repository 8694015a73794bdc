"""WebInstruct-verified (TIGER-Lab/WebInstruct-verified) -> stem__webinstruct.

Source fields: `id`, `question`, `answer`, `answer_type` (e.g. "Float", "Expression", "Boolean",
"Multiple Choice"), `category`, `difficulty`. The prompt is the question and the \\boxed{} instruction; the
ground truth is the answer. Answer types listed in --skip-answer-types (default: Boolean and Multiple Choice,
whose answers can be guessed) are left out, and so are empty answers.

    python -m data_preprocess.stem.webinstruct --input webinstruct-verified.parquet --out data
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from data_preprocess.common import BOXED, Example, require, run_script, user_prompt

SYSTEM = "You are a knowledgeable assistant. Answer the question and think step by step."


def convert(record: dict[str, Any], index: int, args: argparse.Namespace) -> Example | None:
    question, answer = require(record, "question", "answer")
    answer_type = str(record.get("answer_type") or "")
    if not str(answer).strip() or answer_type in args.skip_answer_types:
        return None
    extra = {"id": str(record.get("id", index)), "answer_type": answer_type,
             "category": str(record.get("category") or ""), "difficulty": str(record.get("difficulty") or "")}
    return Example(user_prompt(f"{question.strip()}\n\n{BOXED}", system=SYSTEM), str(answer).strip(), extra)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--skip-answer-types", type=lambda text: [t.strip() for t in text.split(",") if t.strip()],
                        default=["Boolean", "Multiple Choice"],
                        help='comma-separated answer types to leave out ("" keeps all)')


def main(argv: list[str] | None = None) -> Path:
    return run_script(convert, domain="stem", name="webinstruct", description=__doc__, argv=argv,
                      add_arguments=add_arguments)


if __name__ == "__main__":
    main()
