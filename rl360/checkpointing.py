"""Resumable training checkpoints under `<output_dir>/checkpoints/`.

    checkpoints/step_000020/policy/      megatron-core distributed checkpoint: weights + optimizer state, with
                                         hf/ and rl360.json so `rl360 convert megatron-to-hf` reads it
    checkpoints/step_000020/critic/      the same for PPO's critic (weights + optimizer state only)
    checkpoints/step_000020/trainer.json step, data-stream position, adaptive KL coefficient
    checkpoints/step_000020/rollouts_ahead.pt  rollout.mode=async: the steps already drawn ahead of the trainer
                                         (`extra` files, rl360/rollout/ahead.py)
    checkpoints/latest                   the name of the newest complete checkpoint

A checkpoint is written into `step_XXXXXX.partial/`, renamed to `step_XXXXXX/` once everything of it is on
disk, and only then does `latest` move (atomically): a run killed while saving leaves a `.partial`
directory, which nothing reads, and resumes from the previous checkpoint. Sampling seeds derive from the
step number, so a resumed run draws the same prompts and samples as an uninterrupted one.

Which run owns the directory (`open_checkpoints`, at start):
- a run that resumes continues the run that wrote `latest`: it removes what that run left after `latest`
  (`.partial` directories, later steps), so nothing half-written stays behind;
- a run that starts over (`trainer.resume=false`, or no complete checkpoint) never changes another run's
  checkpoints: a non-empty directory is renamed whole to `checkpoints.old-<date>-<time>` (printed), and
  the rest of the earlier run (`RUN_FILES`: its metrics, saved config, log, exported model) is renamed the same
  way (`set_previous_run_aside`, printed).
Pruning (`keep`) only removes complete checkpoints older than the one just written.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

LATEST = "latest"
PARTIAL = ".partial"
_STEP_DIR = re.compile(r"step_(\d{6,})")
# what a run leaves in its output directory beside checkpoints/: a run that starts over moves them aside
RUN_FILES = ("metrics.jsonl", "config.yaml", "train.log", "hf", "wandb_run_id", "tensorboard", "rollouts", "eval")


@dataclass(frozen=True)
class ConvertInfo:
    """What `rl360 convert megatron-to-hf` needs beside a policy's weights: the Hugging Face model it was
    built from (config and tokenizer files are copied), the TP x PP layout and the parameter dtype."""

    model_path: str
    tensor_parallel: int
    pipeline_parallel: int
    dtype: str


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "trainer.json").is_file():
        raise FileNotFoundError(f"{pointer} names {path}, which has no trainer.json: the checkpoint directory "
                                f"was changed by hand; move {root} away (or set trainer.resume=false) to start "
                                "over")
    return path


def open_checkpoints(root: Path, resume: bool) -> Path | None:
    """Make `root` this run's checkpoint directory; the checkpoint to resume from, or None to start over.

    Resuming (`resume` and a complete `latest`): directories the interrupted run wrote after `latest` are
    removed. Starting over: an existing non-empty `root` is moved aside whole, never changed."""
    latest = latest_checkpoint(root) if resume else None
    if latest is not None:
        for leftover in _written_after(root, _step_of(latest)):
            print(f"removing {leftover}: written after {latest.name} by the interrupted run", flush=True)
            shutil.rmtree(leftover)
        return latest
    if root.is_dir() and any(root.iterdir()):
        aside = _set_aside(root)
        print(f"starting over ({_why_over(resume)}): moved {root} aside to {aside}", flush=True)
    return None


def set_previous_run_aside(output_dir: Path, resume: bool) -> list[str]:
    """A run that starts over in `output_dir`: rename what an earlier run left there (`RUN_FILES`) to
    `NAME.old-<date>-<time>`; a line saying what moved where, or none when nothing did."""
    moved = [(path, _set_aside(path)) for path in (output_dir / name for name in RUN_FILES) if path.exists()]
    if not moved:
        return []
    return [f"starting over ({_why_over(resume)}): moved the previous run's "
            + ", ".join(f"{path.name} to {aside.name}" for path, aside in moved) + f" (in {output_dir})"]


def save_checkpoint(root: Path, step: int, models: dict[str, Any], trainer_state: dict, keep: int,
                    convert_info: ConvertInfo | None = None, extra: dict[str, Any] | None = None) -> Path:
    """Write checkpoint `step` (each of `models`, a PolicyGroup by name, saves itself; with `convert_info`,
    `policy/` also gets what `rl360 convert` needs; each of `extra`, file name -> object, is pickled into its
    file), point `latest` at it, then delete all but the newest `keep` complete checkpoints (0: keep all), never
    one newer than `step`."""
    final = root / f"step_{step:06d}"
    if final.exists():
        raise FileExistsError(f"{final} exists: another run is writing to {root} (two runs, one output_dir?)")
    partial = final.with_name(final.name + PARTIAL)
    if partial.exists():  # this run's own leftover (open_checkpoints removed or moved any other)
        shutil.rmtree(partial)
    for name, group in models.items():
        group.call("save_checkpoint", str(partial / name))
    if convert_info is not None:
        write_convert_info(partial / "policy", convert_info)
    for name, value in (extra or {}).items():
        torch.save(value, partial / name)
    (partial / "trainer.json").write_text(json.dumps({"step": step, **trainer_state}, indent=2) + "\n")
    partial.rename(final)
    pointer = root / (LATEST + ".tmp")
    pointer.write_text(final.name + "\n")
    pointer.replace(root / LATEST)
    older = [path for path in _complete_checkpoints(root) if _step_of(path) < step]
    for old in older[:len(older) - (keep - 1)] if keep > 0 else []:
        shutil.rmtree(old)
    return final


def load_checkpoint(path: Path, models: dict[str, Any]) -> dict:
    """Restore each of `models` from `path`; the trainer state (step, data position, ...)."""
    for name, group in models.items():
        if not (path / name).is_dir():
            raise FileNotFoundError(f"checkpoint {path} has no {name}/ (was it written by another algorithm?)")
        group.call("load_checkpoint", str(path / name))
    return json.loads((path / "trainer.json").read_text())


def load_extra(path: Path, name: str) -> Any:
    """The object `save_checkpoint` pickled into checkpoint `path`'s file `name`; None when it has none."""
    return torch.load(path / name, weights_only=False) if (path / name).is_file() else None


def write_convert_info(ckpt_dir: Path, info: ConvertInfo) -> None:
    """`hf/` and `rl360.json` in `ckpt_dir` (`megatron_bridge.checkpoint.write_checkpoint_info`), so
    `rl360 convert` rebuilds the model around the weights the policy saved under "model"."""
    from megatron_bridge.bridge import Bridge
    from megatron_bridge.checkpoint import write_checkpoint_info

    bridge = Bridge.from_hf_pretrained(info.model_path)  # as the policy ranks build theirs
    write_checkpoint_info(ckpt_dir, bridge, info.tensor_parallel, info.pipeline_parallel, info.dtype,
                          model_state_key="model")  # the policy saves {"model": ..., "optimizer": ...}


def _set_aside(path: Path) -> Path:
    """Rename `path` to `NAME.old-<date>-<time>` (or the first free `...-2`, `...-3`); the new path."""
    aside = _free_name(path.with_name(f"{path.name}.old-{time.strftime('%Y%m%d-%H%M%S')}"))
    path.rename(aside)
    return aside


def _why_over(resume: bool) -> str:
    return "trainer.resume=false" if not resume else f"no complete checkpoint ({LATEST}) to resume from"


def _step_of(path: Path) -> int:
    """The step of `step_000012` or `step_000012.partial`."""
    return int(_STEP_DIR.fullmatch(path.name.removesuffix(PARTIAL)).group(1))


def _complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoint directories under `root` (`step_XXXXXX`, not `.partial`), oldest first."""
    return sorted((path for path in root.iterdir() if path.is_dir() and _STEP_DIR.fullmatch(path.name)),
                  key=_step_of)


def _written_after(root: Path, step: int) -> list[Path]:
    """What a run interrupted after checkpoint `step` left: every `.partial` directory and every complete
    checkpoint of a later step."""
    partial = [path for path in root.iterdir()
               if path.is_dir() and path.name.endswith(PARTIAL) and _STEP_DIR.fullmatch(path.name[:-len(PARTIAL)])]
    return sorted(partial + [path for path in _complete_checkpoints(root) if _step_of(path) > step])


def _free_name(path: Path) -> Path:
    """`path`, or `path-2`, `path-3`, ... : the first that does not exist."""
    candidate, number = path, 1
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}-{number}")
    return candidate
