"""Resumable training checkpoints under `<output_dir>/checkpoints/`.

    checkpoints/step_000020/policy/      megatron-core distributed checkpoint: weights + optimizer state
    checkpoints/step_000020/critic/      the same for PPO's critic
    checkpoints/step_000020/trainer.json step, data-stream position, adaptive KL coefficient
    checkpoints/latest                   the name of the newest complete checkpoint

`latest` is replaced (atomically) only after everything else of a checkpoint is written, so a run killed
while saving resumes from the previous one. Sampling seeds derive from the step number, so a resumed run
draws the same prompts and samples as an uninterrupted one: nothing is lost or repeated.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

LATEST = "latest"


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "trainer.json").is_file():
        raise FileNotFoundError(f"{pointer} names {path}, which has no trainer.json: the checkpoint directory "
                                "was changed by hand; remove the pointer to start over")
    return path


def save_checkpoint(root: Path, step: int, models: dict[str, Any], trainer_state: dict, keep: int) -> Path:
    """Write checkpoint `step` (each of `models`, a PolicyGroup by name, saves itself), point `latest` at
    it, and delete all but the newest `keep`."""
    path = root / f"step_{step:06d}"
    if path.exists():
        shutil.rmtree(path)
    for name, group in models.items():
        group.call("save_checkpoint", str(path / name))
    (path / "trainer.json").write_text(json.dumps({"step": step, **trainer_state}, indent=2) + "\n")
    tmp = root / (LATEST + ".tmp")
    tmp.write_text(path.name + "\n")
    tmp.replace(root / LATEST)
    for old in sorted(root.glob("step_*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old)
    return path


def load_checkpoint(path: Path, models: dict[str, Any]) -> dict:
    """Restore each of `models` from `path`; the trainer state (step, data position, ...)."""
    for name, group in models.items():
        if not (path / name).is_dir():
            raise FileNotFoundError(f"checkpoint {path} has no {name}/ (was it written by another algorithm?)")
        group.call("load_checkpoint", str(path / name))
    return json.loads((path / "trainer.json").read_text())
