"""Write the vision quickstart task as parquet in the standard (verl) schema: which colour fills most of the image.

Each row holds one small PNG: a background of one of four colours (red, green, blue, yellow) over most of it and a
few rectangles of the other colours; the prompt "<image>Which colour fills most of the image? ..." asks for the
colour's number (1 red, 2 green, 3 blue, 4 yellow) in \\boxed{}. The prompt's text is the same for every row, so
only the image tells the answer: a model that does not see it is right one time in four. `--blank` writes the
control: every image replaced by a plain grey one of the same size (answers unchanged), which no model can beat
chance on. The ground truth is checked by the `math` reward (math-verify on the last \\boxed{}).

    python -m data_preprocess.synthetic_colours --out data/colours
    python -m data_preprocess.synthetic_colours --out data/colours_blank --blank
"""

from __future__ import annotations

import argparse
import io
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

DATA_SOURCE = "math__synthetic_colours"
COLOURS = {1: ("red", (220, 30, 30)), 2: ("green", (30, 180, 60)), 3: ("blue", (40, 60, 220)),
           4: ("yellow", (240, 220, 40))}
QUESTION = ("<image>Which colour fills most of the image? Answer with its number in \\boxed{}: "
            "1 red, 2 green, 3 blue, 4 yellow.")
SIDES = (56, 84)  # image sides in pixels: 2x2 and 3x3 merged 28-pixel patches for Qwen-VL processors
GREY = (128, 128, 128)


def draw_image(answer: int, side: int, rng: random.Random, blank: bool) -> bytes:
    """PNG bytes: colour `answer` over most of a `side` x `side` square, or plain grey when `blank`."""
    image = Image.new("RGB", (side, side), GREY if blank else COLOURS[answer][1])
    if not blank:
        draw = ImageDraw.Draw(image)
        others = [colour for number, (_, colour) in COLOURS.items() if number != answer]
        for _ in range(rng.randint(1, 3)):  # each rectangle at most a quarter of the side: the background stays most
            width, height = rng.randint(4, side // 4), rng.randint(4, side // 4)
            left, top = rng.randint(0, side - width), rng.randint(0, side - height)
            draw.rectangle([left, top, left + width - 1, top + height - 1], fill=rng.choice(others))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def make_rows(count: int, split: str, seed: int, blank: bool = False) -> list[dict]:
    """`count` rows, answers balanced over the four colours, shuffled with `seed`."""
    rng = random.Random(seed)
    answers = [1 + index % len(COLOURS) for index in range(count)]
    rng.shuffle(answers)
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": QUESTION}],
            "images": [{"bytes": draw_image(answer, rng.choice(SIDES), rng, blank), "path": None}],
            "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"split": split, "index": index, "colour": COLOURS[answer][0], "blank": blank},
        }
        for index, answer in enumerate(answers)
    ]


def write_parquet(rows: list[dict], path: Path, row_group_size: int = 256) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/colours", help="output directory")
    parser.add_argument("--train-rows", type=int, default=2048, help="rows in train.parquet")
    parser.add_argument("--test-rows", type=int, default=128, help="rows in test.parquet")
    parser.add_argument("--blank", action="store_true", help="the control: plain grey images, same answers")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    write_parquet(make_rows(args.train_rows, "train", args.seed, args.blank), out / "train.parquet")
    write_parquet(make_rows(args.test_rows, "test", args.seed + 1, args.blank), out / "test.parquet")
    print(f"wrote {out / 'train.parquet'} and {out / 'test.parquet'}")


if __name__ == "__main__":
    main()
