"""Zebra (Einstein) puzzles -> logic__zebra_puzzle.

Source fields (Reasoning360's zebra puzzle generator): `instruction`, `clues` (a list or one text),
`ground_truth` (the solved grid `{"header": [...], "rows": [[...], ...]}`, as an object, JSON or a Python
literal), `id`. The ground truth is the grid as JSON `{"header", "rows"}` (the reward gives credit per cell);
the prompt asks for that object inside <answer> … </answer>.

    python -m data_preprocess.logic.zebra_puzzle --input zebra_puzzles.json --out data
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from data_preprocess.common import Example, RecordError, answer_tags, parse_literal, require, run_script, user_prompt

GRID_FORMAT = ('Give the solved grid as a JSON object whose "header" lists the attributes and whose "rows" hold '
               "one list of values per position, in the order of the header.")
GRID_EXAMPLE = ('{"header": ["Position", "Nationality", "Job"], '
                '"rows": [["1", "british", "plumber"], ["2", "polish", "carpenter"]]}')


def solved_grid(value: Any) -> dict[str, list]:
    """The `{"header", "rows"}` grid; each row must have one value per header entry."""
    grid = parse_literal(value)
    if not isinstance(grid, dict) or not isinstance(grid.get("header"), list) or not isinstance(grid.get("rows"), list):
        raise RecordError(f"ground_truth must be an object with lists 'header' and 'rows', got {str(value)[:80]!r}")
    header, rows = grid["header"], grid["rows"]
    if any(not isinstance(row, list) or len(row) != len(header) for row in rows):
        raise RecordError(f"every row of ground_truth must have {len(header)} values (one per header entry)")
    return {"header": [str(cell) for cell in header], "rows": [[str(cell) for cell in row] for row in rows]}


def convert(record: dict[str, Any], index: int, args: argparse.Namespace) -> Example:
    instruction, clues, truth = require(record, "instruction", "clues", "ground_truth")
    clue_text = "\n".join(clues) if isinstance(clues, list) else str(clues)
    grid = solved_grid(truth)
    prompt = (f"{instruction.strip()}\n\nThe clues are:\n{clue_text.strip()}\n\n"
              f"{GRID_FORMAT} {answer_tags(GRID_EXAMPLE)}")
    extra = {"id": str(record.get("id", index)), "grid_size": f"{len(grid['rows'])}x{len(grid['header'])}"}
    return Example(user_prompt(prompt), grid, extra)


def main(argv: list[str] | None = None) -> Path:
    return run_script(convert, domain="logic", name="zebra_puzzle", description=__doc__, argv=argv)


if __name__ == "__main__":
    main()
