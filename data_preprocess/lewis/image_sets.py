"""The Lewis-game users' image sets (YoLLaVA, PerVA, ...: one folder of images per concept) -> games -> parquet.

    python -m data_preprocess.lewis.image_sets --input IMAGE_SET_DIR --out data/lewis [--candidates 4] \\
        [--games-per-image 1] [--seed 23] [--vision-listener | --text-listener]
    # -> OUT/speaker.parquet (lewis__speaker) and OUT/listener.parquet (lewis__listener)

IMAGE_SET_DIR holds one sub-folder per concept (its name is the concept: `golden_retriever/`, `mam/`), each with
that concept's images (.jpg, .jpeg, .png, .webp). Every image is the target of `--games-per-image` games whose
other `--candidates - 1` candidates are images of other concepts, drawn with `--seed`; the target's position
among the candidates is drawn too. The listener's first-phase description of a target is "a photo of <concept>"
(underscores as spaces). Candidates are written as absolute paths: the listener service must read the same files
(a shared filesystem). With `--text-listener` the listener rows read each image's PNG `caption` chunk instead of
the image (only for images that carry one, as the CPU quickstart's do).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from data_preprocess.lewis.games import write_games
from rl360.data.lewis import SPEAKER_INSTRUCTION, Game
from rl360.errors import UserError

EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp"}


def concept_images(root: Path) -> dict[str, list[str]]:
    """Concept name -> its images' absolute paths, sorted; UserError when there are fewer than two concepts."""
    if not root.is_dir():
        raise UserError(f"--input {root}: not a directory (expected one sub-folder of images per concept)")
    concepts = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        images = sorted(str(p.resolve()) for p in folder.rglob("*") if p.suffix.lower() in EXTENSIONS)
        if images:
            concepts[folder.name] = images
    if len(concepts) < 2:
        raise UserError(f"--input {root}: {len(concepts)} concept folder(s) with images; a game needs at least two "
                        "concepts (one sub-folder of images per concept)")
    return concepts


def make_games(concepts: dict[str, list[str]], candidates: int, games_per_image: int, seed: int) -> list[Game]:
    if not 2 <= candidates <= len(concepts):
        raise UserError(f"--candidates {candidates}: must be 2 to {len(concepts)} (the number of concepts)")
    rng = random.Random(seed)
    games = []
    for concept, images in concepts.items():
        others = [name for name in concepts if name != concept]
        for path in images:
            for _ in range(games_per_image):
                distractors = [rng.choice(concepts[name]) for name in rng.sample(others, candidates - 1)]
                target = rng.randrange(candidates)
                paths = distractors[:target] + [path] + distractors[target:]
                games.append(Game(tuple(paths), target, f"a photo of {concept.replace('_', ' ')}"))
    rng.shuffle(games)
    return games


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="image set: one sub-folder of images per concept")
    parser.add_argument("--out", default="data/lewis", help="output directory")
    parser.add_argument("--candidates", type=int, default=4, help="images per game, the target among them")
    parser.add_argument("--games-per-image", type=int, default=1, help="games with each image as the target")
    parser.add_argument("--seed", type=int, default=23)
    listener = parser.add_mutually_exclusive_group()
    listener.add_argument("--vision-listener", dest="vision", action="store_true", default=True,
                          help="listener rows show the image (a Qwen2-VL listener; the default)")
    listener.add_argument("--text-listener", dest="vision", action="store_false",
                          help="listener rows read each image's PNG caption chunk")
    args = parser.parse_args(argv)
    games = make_games(concept_images(Path(args.input)), args.candidates, args.games_per_image, args.seed)
    speaker, listener_file = write_games(games, args.out, args.vision, args.seed, SPEAKER_INSTRUCTION)
    print(f"wrote {len(games)} games: {speaker} and {listener_file}")


if __name__ == "__main__":
    main()
