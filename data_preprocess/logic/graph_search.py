"""Graph search puzzles -> logic__graph_search.

Source fields (Reasoning360's graph dataset generator): `prompt` (the graph and the question),
`correct_response` (the answer: a choice letter), `look_ahead`, `id`. The ground truth is the answer text;
the prompt asks for it alone inside <answer> … </answer>.

    python -m data_preprocess.logic.graph_search --input graph_search.json --out data
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from data_preprocess.common import Example, RecordError, answer_tags, require, run_script, user_prompt


def convert(record: dict[str, Any], index: int, args: argparse.Namespace) -> Example:
    question, answer = require(record, "prompt", "correct_response")
    answer = str(answer).strip()
    if not answer:
        raise RecordError("field 'correct_response' is empty")
    prompt = f"{question.strip()}\n\n{answer_tags('B')} Inside the tags give the answer alone."
    look_ahead = record.get("look_ahead")
    extra = {"id": str(record.get("id", index)), "look_ahead": -1 if look_ahead is None else int(look_ahead)}
    return Example(user_prompt(prompt), answer, extra)


def main(argv: list[str] | None = None) -> Path:
    return run_script(convert, domain="logic", name="graph_search", description=__doc__, argv=argv)


if __name__ == "__main__":
    main()
