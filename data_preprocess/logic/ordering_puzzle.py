"""Ordering puzzles -> logic__ordering_puzzle.

Source fields (Reasoning360's ordering puzzle generator): `instruction`, `input` (the constraints),
`ground_truth` (the ordered list of objects, as a list, JSON or a Python literal), `num_objects`, `id`. The
ground truth is that list as JSON; the prompt asks for the whole ordering as a list inside <answer> … </answer>.

    python -m data_preprocess.logic.ordering_puzzle --input puzzles_dataset.json --out data
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from data_preprocess.common import Example, RecordError, answer_tags, parse_literal, require, run_script, user_prompt

ORDER_FORMAT = "Give the complete ordering as a list, first object first."
ORDER_EXAMPLE = "['pigeon', 'sparrow', 'quail']"


def convert(record: dict[str, Any], index: int, args: argparse.Namespace) -> Example:
    instruction, constraints, truth = require(record, "instruction", "input", "ground_truth")
    order = parse_literal(truth)
    if not isinstance(order, list) or not order:
        raise RecordError(f"ground_truth must be a non-empty list, got {str(truth)[:80]!r}")
    order = [str(item) for item in order]
    constraint_text = "\n".join(constraints) if isinstance(constraints, list) else str(constraints)
    prompt = (f"{instruction.strip().rstrip('.')}.\n\nThe constraints are:\n{constraint_text.strip()}\n\n"
              f"{ORDER_FORMAT} {answer_tags(ORDER_EXAMPLE)}")
    extra = {"id": str(record.get("id", index)), "num_objects": len(order)}
    return Example(user_prompt(prompt), order, extra)


def main(argv: list[str] | None = None) -> Path:
    return run_script(convert, domain="logic", name="ordering_puzzle", description=__doc__, argv=argv)


if __name__ == "__main__":
    main()
