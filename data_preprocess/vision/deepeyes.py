"""DeepEyes-Datasets-47k (ChenShawn/DeepEyes-Datasets-47k) -> stem_web__deepeyes, scored by the LLM judge.

Source fields (its parquet files, one per subset): `data_source` (`vstar`, `chart`, `thinklite_eureka`),
`prompt` (a system message and a user message: `<image>`, the question, then DeepEyes' instructions for its
image_zoom_in_tool and <answer> format; ThinkLite's put the instructions first and the question after
"Question:"), `images` (one image each), `reward_model.ground_truth` (a short free-form answer, an option letter,
or a number).

The prompt is the question (the tool and format instructions removed: rl360 has no zoom-in tool) with its
`<image>`, followed by the \\boxed{} instruction. DeepEyes grades answers with an LLM judge, so the rows go to
the judge route that exists, `stem_web*` (`rl360.rewards.judged:stem_web_score`): the last \\boxed{} of the
response is compared with the ground truth by the judge, for the question in extra_info.question, with the
`verifier` template (extra_info.judge_template), which asks for "Final Decision: Yes/No" as DeepEyes' judge
does. Training on these rows needs `reward.judge` configured.

Tiny ThinkLite images (a side under 28 pixels) are kept as they are; rl360.data.images scales them up when
they are rendered. `--skip-sources chart` leaves out the chart subset, whose very large images the verl recipe
also leaves out.

    python -m data_preprocess.vision.deepeyes --input DeepEyes-Datasets-47k/ --out data --skip-sources chart
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from data_preprocess.common import BOXED, Example, RecordError, require, run_script, user_prompt
from data_preprocess.vision.images import input_dir, record_images, strip_placeholders, with_placeholders
from rl360.data.images import IMAGE_PLACEHOLDER

JUDGE_TEMPLATE = "verifier"
_TOOL_INSTRUCTIONS = re.compile(r"\n\s*Think first,? call \**image_zoom_in_tool\**", re.IGNORECASE)
_QUESTION_LABEL = re.compile(r"(?:^|\n)\s*Question:\s*\n?")


def bare_question(user_text: str) -> str:
    """The question of a DeepEyes user message, its images' placeholders kept in front: the text before the
    zoom-in tool instructions, or (ThinkLite) the text after the last "Question:" label."""
    if _TOOL_INSTRUCTIONS.search(user_text):
        return _TOOL_INSTRUCTIONS.split(user_text, maxsplit=1)[0].strip()
    labels = list(_QUESTION_LABEL.finditer(user_text))
    if labels:
        head, question = user_text[: labels[-1].start()], user_text[labels[-1].end():]
        return IMAGE_PLACEHOLDER * head.count(IMAGE_PLACEHOLDER) + question.strip()
    return user_text.strip()


def convert(record: dict[str, Any], index: int, args: argparse.Namespace) -> Example | None:
    subset = str(record.get("data_source") or "")
    if subset in args.skip_sources:
        return None
    messages, reward, images = require(record, "prompt", "reward_model", "images")
    users = [message["content"] for message in messages if message.get("role") == "user"]
    if not users:
        raise RecordError("field 'prompt' has no user message")
    answer = str(require(reward, "ground_truth")).strip()
    if not answer:
        raise RecordError("field 'reward_model.ground_truth' is empty")
    images = record_images(images, "images", input_dir(args))
    question = with_placeholders(bare_question(users[-1]), len(images))
    extra = {"question": strip_placeholders(question), "judge_template": JUDGE_TEMPLATE, "subset": subset}
    return Example(user_prompt(f"{question}\n{BOXED}"), answer, extra, images=images)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--skip-sources", default="", type=lambda text: {s for s in text.split(",") if s},
                        help="comma-separated DeepEyes data_source values to leave out, e.g. chart")


def main(argv: list[str] | None = None) -> Path:
    return run_script(convert, domain="stem_web", name="deepeyes", description=__doc__, argv=argv,
                      add_arguments=add_arguments)


if __name__ == "__main__":
    main()
