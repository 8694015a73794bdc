"""The CPU quickstart's Lewis games: coloured shapes among distractors.

Every game has four candidates, one of each colour (red, green, blue, yellow), each a circle, square or triangle
on grey, drawn as a 56 x 56 PNG that carries its caption ("red circle") in the PNG text chunk `caption`, which is
what a text-only listener reads in place of the pixels. The target is one candidate at random; its colour alone
tells it apart, so a speaker that names the colour it sees and a listener that matches the named colour to the
captions win every game. The listener's first-phase description of a target is its colour word.

    python -m data_preprocess.lewis.synthetic_shapes --out data/lewis_shapes [--games 512]
    # -> OUT/images/*.png, OUT/speaker.parquet, OUT/listener.parquet
"""

from __future__ import annotations

import argparse
import io
import random
from pathlib import Path

from PIL import Image, ImageDraw
from PIL.PngImagePlugin import PngInfo

from data_preprocess.lewis.games import write_games
from rl360.data.lewis import CAPTION_KEY, Game

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (240, 220, 40)}
SHAPES = ("circle", "square", "triangle")
SIDE = 56
GREY = (128, 128, 128)
INSTRUCTION = "<image>Name the colour of the shape."


def draw_shape(colour: str, shape: str, rng: random.Random) -> bytes:
    """PNG bytes of one shape, its caption in the `caption` text chunk."""
    image = Image.new("RGB", (SIDE, SIDE), GREY)
    draw = ImageDraw.Draw(image)
    size = rng.randint(30, 44)
    left, top = rng.randint(2, SIDE - size - 2), rng.randint(2, SIDE - size - 2)
    box = [left, top, left + size, top + size]
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(left + size // 2, top), (left, top + size), (left + size, top + size)], fill=fill)
    info = PngInfo()
    info.add_text(CAPTION_KEY, f"{colour} {shape}")
    out = io.BytesIO()
    image.save(out, format="PNG", pnginfo=info)
    return out.getvalue()


def make_games(count: int, image_dir: Path, seed: int = 0) -> list[Game]:
    rng = random.Random(seed)
    image_dir.mkdir(parents=True, exist_ok=True)
    games = []
    for number in range(count):
        colours = list(COLOURS)
        rng.shuffle(colours)
        paths = []
        for slot, colour in enumerate(colours):
            path = image_dir / f"game{number:05d}_{slot}.png"
            path.write_bytes(draw_shape(colour, rng.choice(SHAPES), rng))
            paths.append(str(path.resolve()))
        target = rng.randrange(len(paths))
        games.append(Game(tuple(paths), target, colours[target]))
    return games


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/lewis_shapes", help="output directory")
    parser.add_argument("--games", type=int, default=512, help="games (speaker rows; twice as many listener rows)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    games = make_games(args.games, out / "images", args.seed)
    speaker, listener = write_games(games, out, vision_listener=False, seed=args.seed, instruction=INSTRUCTION)
    print(f"wrote {len(games)} games: {speaker} and {listener} (images in {out / 'images'})")


if __name__ == "__main__":
    main()
