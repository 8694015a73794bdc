"""DeepVision-103K (skylenage/DeepVision-103K: math-77k and visual_logic-26k) -> math__deepvision.

Accepted records, in the source's own fields:
- its training rows (verl layout): `prompt` (chat messages; the last user message holds the question, with an
  `<image>` placeholder per image), `images`, `reward_model.ground_truth`, `data_source` (the subset, e.g.
  "math-77k");
- question-answer records (its evaluation files' layout): `question`, `answer`, and `images` (a list) or
  `image`, as paths (taken from the input's directory) or image items.

The prompt is the question with one `<image>` per image (put in front when the question has none) followed by
the \\boxed{} instruction unless the question already asks for a \\boxed{} answer; the images travel in the
`images` column. The ground truth is the answer, which the `math` reward compares with the last \\boxed{} by
math-verify, as DeepVision's own math-verify reward does. extra_info.subset keeps the source's data_source.

    python -m data_preprocess.vision.deepvision --input DeepVision-103K/math-77k.parquet --out data
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from data_preprocess.common import BOXED, Example, RecordError, require, run_script, user_prompt
from data_preprocess.vision.images import input_dir, record_images, with_placeholders


def question_answer_images(record: dict[str, Any], base_dir: Path) -> tuple[str, str, list[bytes]]:
    """The question text, the answer and the images of a record of either layout."""
    if "prompt" in record and "reward_model" in record:
        messages, reward, images = require(record, "prompt", "reward_model", "images")
        users = [message["content"] for message in messages if message.get("role") == "user"]
        if not users:
            raise RecordError("field 'prompt' has no user message")
        question, answer, field = users[-1], require(reward, "ground_truth"), "images"
    else:
        question, answer = require(record, "question", "answer")
        field = "images" if record.get("images") is not None else "image"
        images = require(record, field)
    return question.strip(), str(answer).strip(), record_images(images, field, base_dir)


def convert(record: dict[str, Any], index: int, args: argparse.Namespace) -> Example:
    question, answer, images = question_answer_images(record, input_dir(args))
    if not answer:
        raise RecordError("the answer is empty")
    text = with_placeholders(question, len(images))
    if "\\boxed" not in text:
        text = f"{text} {BOXED}"
    return Example(user_prompt(text), answer, {"subset": str(record.get("data_source") or "")}, images=images)


def main(argv: list[str] | None = None) -> Path:
    return run_script(convert, domain="math", name="deepvision", description=__doc__, argv=argv)


if __name__ == "__main__":
    main()
