"""Write the zoom quickstart task as parquet in the standard (verl) schema: the colour of a mark legible only
when zoomed in.

Each row holds one grey PNG of SIDE x SIDE pixels with a mark in its top-left MARK x MARK corner (the box
`BBOX`): a one-pixel checkerboard of one of four colours (1 red, 2 green, 3 blue, 4 yellow) and its
complement. The prompt asks for the mark's colour as a number in \\boxed{}. A Qwen-VL model whose processor
bounds images to a smaller area (the quickstart model's: 112 x 112 pixels) sees the image halved, and halving
averages each pair of checkerboard pixels to the background's grey: the whole image is the same grey for every
answer. The `image_zoom_in_tool` crop of `BBOX` comes back at full resolution, checkerboard and colour intact.
So the answer is guessable at chance (1 in 4) without the tool and legible with it. The ground truth is checked
by the `math` reward (math-verify on the last \\boxed{}). Rows are laid out as DeepEyes' (verl's DeepEyes recipe)
are: `extra_info.need_tools_kwargs` and `extra_info.tools_kwargs.image_zoom_in_tool.create_kwargs.image`, the
row's image as a data URI.

    python -m data_preprocess.synthetic_zoom --out data/zoom
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
from pathlib import Path

from PIL import Image

from data_preprocess.synthetic_colours import COLOURS, write_parquet

DATA_SOURCE = "math__synthetic_zoom"
SIDE, MARK = 448, 56
BBOX = [0, 0, MARK, MARK]
GREY = (128, 128, 128)
QUESTION = ("<image>What colour is the mark in the top left corner? Answer with its number in \\boxed{}: "
            "1 red, 2 green, 3 blue, 4 yellow.")
# the whole `image_zoom_in_tool` call (DeepEyes' and verl's name) on the mark's box, as Qwen's Hermes format writes
# it (one token of the quickstart tokenizer), and the tool's reply text to it
CALL = "<tool_call>" + json.dumps({"name": "image_zoom_in_tool", "arguments": {"bbox_2d": BBOX}}) + "</tool_call>"
REPLY = f"Zoomed in on the image to the region {BBOX}."  # the tool's reply, as DeepEyes words it
# the quickstart model's probability of writing CALL first in its reply, set when it is built (an instruct model's
# habit of calling its tools: it tells nothing about the answer)
CALL_PRIOR = 0.5


def draw_image(answer: int) -> bytes:
    """PNG bytes: grey, with the checkerboard of colour `answer` and its complement in the box BBOX."""
    image = Image.new("RGB", (SIDE, SIDE), GREY)
    colour = COLOURS[answer][1]
    complement = tuple(256 - value for value in colour)  # the pair averages to GREY exactly
    pixels = image.load()
    for y in range(MARK):
        for x in range(MARK):
            pixels[x, y] = colour if (x + y) % 2 == 0 else complement
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def make_rows(count: int, split: str, seed: int) -> list[dict]:
    """`count` rows, answers balanced over the four colours, shuffled with `seed`."""
    rng = random.Random(seed)
    answers = [1 + index % len(COLOURS) for index in range(count)]
    rng.shuffle(answers)
    images = {answer: draw_image(answer) for answer in COLOURS}
    uris = {answer: "data:image/png;base64," + base64.b64encode(data).decode() for answer, data in images.items()}
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": QUESTION}],
            "images": [{"bytes": images[answer], "path": None}],
            "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"split": split, "index": index, "colour": COLOURS[answer][0], "need_tools_kwargs": True,
                           "tools_kwargs": {"image_zoom_in_tool": {"create_kwargs": {"image": uris[answer]}}}},
        }
        for index, answer in enumerate(answers)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/zoom", help="output directory")
    parser.add_argument("--train-rows", type=int, default=2048, help="rows in train.parquet")
    parser.add_argument("--test-rows", type=int, default=128, help="rows in test.parquet")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    write_parquet(make_rows(args.train_rows, "train", args.seed), out / "train.parquet")
    write_parquet(make_rows(args.test_rows, "test", args.seed + 1), out / "test.parquet")
    print(f"wrote {out / 'train.parquet'} and {out / 'test.parquet'}")


if __name__ == "__main__":
    main()
