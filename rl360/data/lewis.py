"""The Lewis signalling game's prompts, in one place for the data, the listener service and the rewards.

A game: `candidates` images (paths), one of them the target. The speaker sees the target and writes
`<thinking>…</thinking><coarse>…</coarse><detailed>…</detailed>`; its description
(`rl360.rewards.lewis.speaker_description`: the coarse and detailed texts) goes to the listener, which scores
every candidate with P("Yes") for the question `listener_question(description)` about that image and picks the
most probable one.

- `listener_prompt(question, image, vision)`: the listener's chat messages (and images) for one candidate: the
  image itself for a vision-language listener (`<image>` then the question); for a text-only listener, the
  image's caption (`image_caption`: the PNG text chunk `caption`) written out as text. `serve listener` scores,
  and the listener's training rows ask, exactly these prompts.
- `listener_row(...)`: one listener training row (data_source `lewis__listener`, ground truth "Yes"/"No").
- A game is `Game(paths, target, description)`: the candidates' image files (absolute paths: the listener
  service reads them), the target's index and a description of the target (a caption or class name before any
  speaker has written one, else a speaker's). `speaker_rows(games)`: one `lewis__speaker` row per game (the
  target image; the reward sends the speaker's description and the candidates' paths to the listener service);
  `listener_rows(games, vision)`: two `lewis__listener` rows per game, the target ("Yes") and one random
  distractor ("No") asked about the game's description, so a listener that always answers alike is right half
  the time.
"""

from __future__ import annotations

import io
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl360.data.schema import DataError

SPEAKER_DATA_SOURCE = "lewis__speaker"
LISTENER_DATA_SOURCE = "lewis__listener"
YES, NO = "Yes", "No"
QUESTION_TEMPLATE = "Description: {description}\nDoes the description match the image? Answer Yes or No."
CAPTION_KEY = "caption"  # the PNG text chunk a text-only listener reads an image from
SPEAKER_INSTRUCTION = ("<image>Describe this image so that a listener can pick it out among similar ones. Write "
                       "your reasoning in <thinking></thinking>, a short description in <coarse></coarse> and one "
                       "detailed sentence in <detailed></detailed>.")


def listener_question(description: str, template: str = QUESTION_TEMPLATE) -> str:
    return template.format(description=description)


def image_caption(data: bytes, where: str = "image") -> str:
    """The `caption` text chunk of a PNG (what a text-only listener reads instead of the pixels); DataError
    naming `where` when it has none."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            caption = getattr(image, "text", {}).get(CAPTION_KEY)
    except Exception as err:
        raise DataError(f"{where}: not a readable image ({type(err).__name__})") from None
    if not caption:
        raise DataError(f"{where}: a text-only listener reads an image's PNG text chunk {CAPTION_KEY!r}, and this "
                        "image has none; serve a vision-language listener, or write captions into the PNGs")
    return str(caption)


def listener_prompt(question: str, image: bytes, vision: bool, where: str = "image"
                    ) -> tuple[list[dict[str, str]], list[bytes]]:
    """The listener's (messages, images) for one candidate `image` (PNG/JPEG bytes)."""
    if vision:
        return [{"role": "user", "content": "<image>" + question}], [image]
    return [{"role": "user", "content": f"Image: {image_caption(image, where)}\n{question}"}], []


def listener_row(question: str, image: bytes, vision: bool, is_target: bool, index: int, split: str = "train",
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One listener training row: the prompt for (`question`, `image`), ground truth "Yes" for the target."""
    messages, images = listener_prompt(question, image, vision, f"row {index}")
    row = {"data_source": LISTENER_DATA_SOURCE, "prompt": messages, "ability": "lewis",
           "reward_model": {"style": "rule", "ground_truth": YES if is_target else NO},
           "extra_info": {"split": split, "index": index, **(extra or {})}}
    if images:
        row["images"] = [{"bytes": data, "path": None} for data in images]
    return row


def speaker_row(target: bytes, candidate_paths: Sequence[str], target_index: int, index: int,
                instruction: str = SPEAKER_INSTRUCTION, split: str = "train") -> dict[str, Any]:
    """One speaker training row: the target image and the instruction; the reward asks the listener about
    `candidate_paths` (files the listener service can read) and pays when it picks `target_index`."""
    if not 0 <= target_index < len(candidate_paths):
        raise ValueError(f"row {index}: target_index {target_index} is not one of the {len(candidate_paths)} "
                         "candidates")
    return {"data_source": SPEAKER_DATA_SOURCE, "prompt": [{"role": "user", "content": instruction}],
            "images": [{"bytes": target, "path": None}], "ability": "lewis",
            "reward_model": {"style": "rule", "ground_truth": str(target_index)},
            "extra_info": {"split": split, "index": index, "candidate_paths": list(candidate_paths)}}


@dataclass(frozen=True)
class Game:
    paths: tuple[str, ...]
    target: int
    description: str


def speaker_rows(games: Sequence[Game], instruction: str = SPEAKER_INSTRUCTION, split: str = "train"
                 ) -> list[dict[str, Any]]:
    return [speaker_row(Path(game.paths[game.target]).read_bytes(), game.paths, game.target, index, instruction,
                        split) for index, game in enumerate(games)]


def listener_rows(games: Sequence[Game], vision: bool, seed: int = 0, split: str = "train"
                  ) -> list[dict[str, Any]]:
    """Per game, the target's row and a random distractor's, asked about the game's description; shuffled."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for number, game in enumerate(games):
        question = listener_question(game.description)
        distractor = rng.choice([i for i in range(len(game.paths)) if i != game.target])
        for candidate in (game.target, distractor):
            rows.append(listener_row(question, Path(game.paths[candidate]).read_bytes(), vision,
                                     candidate == game.target, len(rows), split,
                                     {"game": number, "candidate": candidate}))
    rng.shuffle(rows)
    return rows


def games_of(rows: Sequence[dict[str, Any]], descriptions: Sequence[str]) -> list[Game]:
    """The games of speaker rows, each with a description (e.g. what a speaker wrote for it)."""
    return [Game(tuple(row["extra_info"]["candidate_paths"]), int(row["reward_model"]["ground_truth"]), text)
            for row, text in zip(rows, descriptions, strict=True)]


def write_rows(rows: list[dict[str, Any]], path: str | Path, row_group_size: int = 256) -> Path:
    """Rows, each validated as the trainer reads it, to parquet (written to a temporary name, then renamed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rl360.data.schema import validate_file_schema, validate_row

    path = Path(path)
    for index, row in enumerate(rows):
        validate_row(row, str(path), index)
    table = pa.Table.from_pylist(rows)
    validate_file_schema(str(path), table.schema)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".parquet.partial")
    pq.write_table(table, partial, row_group_size=row_group_size)
    partial.replace(path)
    return path
