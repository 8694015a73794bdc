"""Geometry3K (hiyouga/geometry3k) -> math__geometry3k.

Source fields: `problem` (the text, with an `<image>` placeholder where the diagram goes), `answer` (e.g. "3",
"8 \\sqrt { 3 }"), `images` (the diagram: one image, as Hugging Face's Image feature stores it). The prompt is the
problem followed by the \\boxed{} instruction, with its image; the ground truth is the answer, which the `math`
reward compares with the last \\boxed{} by math-verify. (verl's own `hiyouga/geometry3k` rows, with its
<think>-format instruction, route to the geometry3k reward unchanged; they need no script.)

    python -m data_preprocess.vision.geometry3k --input geometry3k/train.parquet --out data
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from data_preprocess.common import BOXED, Example, RecordError, require, run_script, user_prompt
from data_preprocess.vision.images import input_dir, record_images, with_placeholders


def convert(record: dict[str, Any], index: int, args: argparse.Namespace) -> Example:
    problem, answer, images = require(record, "problem", "answer", "images")
    images = record_images(images, "images", input_dir(args))
    answer = str(answer).strip()
    if not answer:
        raise RecordError("field 'answer' is empty")
    text = with_placeholders(problem.strip(), len(images))
    return Example(user_prompt(f"{text} {BOXED}"), answer, images=images)


def main(argv: list[str] | None = None) -> Path:
    return run_script(convert, domain="math", name="geometry3k", description=__doc__, argv=argv)


if __name__ == "__main__":
    main()
