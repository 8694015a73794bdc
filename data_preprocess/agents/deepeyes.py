"""DeepEyes-Datasets-47k (ChenShawn/DeepEyes-Datasets-47k) -> agent rows for `configs/recipes/deepeyes.yaml`.

Source fields (its parquet files, one per subset): `data_source` (`vstar`, `chart`, `thinklite_eureka`),
`prompt` (a system and a user message: `<image>`, the question, then DeepEyes' instructions for its
`image_zoom_in_tool` and the `<think>` / `<tool_call>` / `<answer>` format; ThinkLite's put the instructions first
and the question after "Question:"), `images` (one image each), `reward_model.ground_truth` (a short answer, an
option letter or a number).

Each row keeps the record's `data_source`, so DeepEyes' reward scores it (`rl360.rewards.agentic:deepeyes_score`:
judge accuracy, format, tool bonus), and its user message as DeepEyes wrote it, tool name included
(`image_zoom_in_tool`, rl360's name for the tool too). The system message is the verl recipe's instruction (one
call at a time, wait for its result) with the `image_zoom_in_tool` description in Qwen's tools layout.
extra_info.question holds the bare question, which the judge reads; extra_info.subset the source's data_source.

`--skip-sources chart` leaves out the chart subset, as the verl recipe does: its very large images, cropped,
stay large (rl360 bounds a trajectory's crops by agent.max_image_tokens and model.max_pixels, but the subset
costs memory all the same).

    python -m data_preprocess.agents.deepeyes --input DeepEyes-Datasets-47k/ --out data --skip-sources chart
    # -> data/train/agent__deepeyes.parquet
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from data_preprocess.agents.tools_prompt import tools_system_prompt
from data_preprocess.common import Example, RecordError, require, run_script, user_prompt
from data_preprocess.vision.deepeyes import add_arguments, bare_question
from data_preprocess.vision.images import input_dir, record_images, strip_placeholders, with_placeholders

TOOLS = ["image_zoom_in_tool"]
INSTRUCTION = ("You are a helpful assistant. You can call functions to help answer the user's question. Call one "
               "function at a time, and wait for its result before you call the next one.")


def convert(record: dict[str, Any], index: int, args: argparse.Namespace) -> Example | None:
    source = str(record.get("data_source") or "")
    if not source:
        raise RecordError("field 'data_source' is empty")
    if source in args.skip_sources:
        return None
    messages, reward, images = require(record, "prompt", "reward_model", "images")
    users = [message["content"] for message in messages if message.get("role") == "user"]
    if not users:
        raise RecordError("field 'prompt' has no user message")
    answer = str(require(reward, "ground_truth")).strip()
    if not answer:
        raise RecordError("field 'reward_model.ground_truth' is empty")
    images = record_images(images, "images", input_dir(args))
    text = with_placeholders(users[-1].strip(), len(images))
    extra = {"question": strip_placeholders(bare_question(users[-1])), "subset": source}
    return Example(user_prompt(text, tools_system_prompt(INSTRUCTION, TOOLS)), answer, extra, images=images,
                   data_source=source)


def main(argv: list[str] | None = None) -> Path:
    return run_script(convert, domain="agent", name="deepeyes", description=__doc__, argv=argv,
                      add_arguments=add_arguments)


if __name__ == "__main__":
    main()
