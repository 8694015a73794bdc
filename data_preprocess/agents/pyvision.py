"""PyVision's RL data -> agent rows for `configs/recipes/pyvision.yaml`.

Accepted records, in PyVision's own fields:
- its question files (the layout its dataset code turns into prompts): `data_source` (`deepeyes`, `vstar`,
  `zebra_cot`, `vigorl`, `minio3`, ...), `question`, `answer`, `image_path` (taken from the input's directory)
  or `images`, optional `id`;
- its verl rows (e.g. Agents-X/de_visual_search_filtered): `data_source`, `prompt` (the user message: `<image>`
  and PyVision's instructions around the question), `images`, `reward_model.ground_truth`, and the bare question
  in `extra_info.question`.

The prompt gives PyVision's task in PyVision's format, which the recipe's `pyvision` parser reads: the model
writes its code in `<code>```python ...```</code>` blocks, the images are already loaded as `image_clue_0`, ...
(PIL images), each image's width and height is stated as PyVision's prompt states it, results come back in
`<interpreter>...</interpreter>` and the answer goes in `<answer>...</answer>`. Each row keeps the record's
`data_source` and sets `extra_info.reward_metric = "pyvision"`, so PyVision's judge reward scores it even under
names DeepEyes' data shares (`vstar`, `chart`); extra_info.question holds the question the judge reads.

    python -m data_preprocess.agents.pyvision --input visual_search.json --out data
    # -> data/train/agent__pyvision.parquet
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import Any

from PIL import Image

from data_preprocess.common import Example, RecordError, require, run_script, user_prompt
from data_preprocess.vision.images import input_dir, record_images, strip_placeholders, with_placeholders

SYSTEM = """\
You are an agent that solves visual questions step by step by writing Python code over the images. To run code, \
write one block in this form and stop:
<code>
```python
# your code
```
</code>
The code runs in a Python session that persists from one block to the next (variables and imports carry over). \
Its result comes back in <interpreter>...</interpreter>: what it prints under "Text Result:", and the images it \
shows (plt.show(), or an image's .show()) under "Image Result:", each tagged image_clue_N with the next number N \
and loaded in the session under that name. Plan before each block and reflect on its result before you go on."""
TASK = """\
Solve the problem below step by step. The images are already loaded in the Python session: the i-th image is \
the PIL image `image_clue_i` (also saved as a file of that name). Write code whenever zooming in, rotating, \
adjusting contrast, measuring or computing could help you see better. Show an image you make with plt.show() (or \
its .show()); print any value you want to see.

{sizes}

Question: {question}

End your reply with the final answer alone in <answer>...</answer>."""


def question_answer_images(record: dict[str, Any], base_dir: Path) -> tuple[str, str, list[bytes]]:
    """The bare question, the answer and the images of a record of either layout."""
    if "prompt" in record and "reward_model" in record:
        messages, reward, images = require(record, "prompt", "reward_model", "images")
        info = record.get("extra_info") or {}
        users = [message["content"] for message in messages if message.get("role") == "user"]
        question = info.get("question") or (users[-1] if users else "")
        return strip_placeholders(str(question)), str(require(reward, "ground_truth")), \
            record_images(images, "images", base_dir)
    question, answer = require(record, "question", "answer")
    field = "image_path" if record.get("image_path") is not None else "images"
    return str(question).strip(), str(answer), record_images(require(record, field), field, base_dir)


def sizes_line(images: list[bytes]) -> str:
    """Each image's resolution, as PyVision's prompt states it."""
    lines = []
    for number, data in enumerate(images):
        width, height = Image.open(io.BytesIO(data)).size
        lines.append(f"image_clue_{number}: width {width}, height {height}")
    return "Image resolution: " + "; ".join(lines) + "."


def convert(record: dict[str, Any], index: int, args: argparse.Namespace) -> Example:
    source = str(record.get("data_source") or "")
    if not source:
        raise RecordError("field 'data_source' is empty")
    question, answer, images = question_answer_images(record, input_dir(args))
    answer = answer.strip()
    if not question or not answer:
        raise RecordError("the question or the answer is empty")
    text = with_placeholders(TASK.format(sizes=sizes_line(images), question=question), len(images))
    extra = {"question": question, "reward_metric": "pyvision", "subset": source}
    return Example(user_prompt(text, SYSTEM), answer, extra, images=images,
                   data_source=source)


def main(argv: list[str] | None = None) -> Path:
    return run_script(convert, domain="agent", name="pyvision", description=__doc__, argv=argv)


if __name__ == "__main__":
    main()
