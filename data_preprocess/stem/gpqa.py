"""GPQA (Idavidrein/gpqa; gpqa_main.csv, gpqa_diamond.csv, ...) -> stem__gpqa.

Source fields: `Question`, `Correct Answer`, `Incorrect Answer 1` … `Incorrect Answer 3`, `Record ID`,
`High-level domain`, `Subdomain`. The four choices are shuffled per record (seeded by --seed and the record's
index) and labelled (A)-(D); the ground truth is the letter of the correct choice, which the prompt asks for
inside \\boxed{}.

    python -m data_preprocess.stem.gpqa --input gpqa_diamond.csv --out data --split test --name gpqa_diamond
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from data_preprocess.common import BOXED, Example, RecordError, record_rng, require, run_script, user_prompt

LETTERS = "ABCD"


def convert(record: dict[str, Any], index: int, args: argparse.Namespace) -> Example:
    question, correct = require(record, "Question", "Correct Answer")
    wrong = require(record, "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
    choices = [str(text).strip() for text in (correct, *wrong)]
    if len(set(choices)) != 4:
        raise RecordError("the four answer choices are not distinct")
    record_rng(args, index).shuffle(choices)
    letter = LETTERS[choices.index(str(correct).strip())]
    listed = "\n".join(f"({label}) {text}" for label, text in zip(LETTERS, choices))
    prompt = (f"{question.strip()}\n\nChoices:\n{listed}\n\nReason step by step, then give the letter of the "
              f"correct choice. {BOXED}")
    extra = {"id": str(record.get("Record ID") or index), "domain": str(record.get("High-level domain") or ""),
             "subdomain": str(record.get("Subdomain") or "")}
    return Example(user_prompt(prompt), letter, extra)


def main(argv: list[str] | None = None) -> Path:
    return run_script(convert, domain="stem", name="gpqa", description=__doc__, argv=argv)


if __name__ == "__main__":
    main()
