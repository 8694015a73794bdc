"""Games (`rl360.data.lewis.Game`: candidate image files, one the target, a description of it) -> parquet:
`write_games` writes `speaker.parquet` (`speaker_rows`) and `listener.parquet` (`listener_rows`, for the listener's
first phase, asked about the games' own descriptions), each row validated as the trainer reads it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rl360.data.lewis import SPEAKER_INSTRUCTION, Game, listener_rows, speaker_rows, write_rows


def write_games(games: Sequence[Game], out: str | Path, vision_listener: bool, seed: int = 0,
                instruction: str = SPEAKER_INSTRUCTION, split: str = "train") -> tuple[Path, Path]:
    out = Path(out)
    return (write_rows(speaker_rows(games, instruction, split), out / "speaker.parquet"),
            write_rows(listener_rows(games, vision_listener, seed, split), out / "listener.parquet"))
