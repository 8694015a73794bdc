"""What a training run checks before anything slow starts: no model is loaded, no worker or Ray started, and
none of the trainer's heavy modules (megatron-core, the engines) imported, so `rl360 train` answers a mistake in
about two seconds.

- what the config needs installed (SGLang, Transformer Engine, a CUDA device, sglang-router: rl360.installed);
- every directory the run writes: output_dir, its checkpoints/ and hf/ (a directory that can be written in, or
  one that can be created: never under a regular file, /proc or a directory it may not write in);
- the model directory (config.json, weights, tokenizer);
- resuming: the config saved with the run against this one (changes a checkpoint cannot take are refused);
- `reward.custom` references importable;
- the agent's tools and parser known;
- every row of every data file (prompt, data_source route, ground truth), on those columns only.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl360.agents.build import agent_from_config
from rl360.checkpointing import latest_checkpoint
from rl360.config import ConfigError, RunConfig
from rl360.installed import check_installed
from rl360.model_dir import check_model_dir
from rl360.rewards import register_reward_path
from rl360.rewards.check import check_reward_data, judge_configured
from rl360.run_config import check_resume


@dataclass
class CheckedRun:
    """What the checks found, for the run to start from."""

    out: Path
    latest: Path | None  # the checkpoint to resume from (None: starting over)
    resume_notes: list[str]  # each config change a resume takes, one line each
    agent: Any  # the multi-turn agent (None: one reply per prompt)
    routes: dict  # data_source -> its reward route


def check_run(cfg: RunConfig) -> CheckedRun:
    """Check `cfg` and its files as the docstring above says; a `UserError` naming what is wrong."""
    check_installed(cfg)  # SGLang, Transformer Engine, a GPU, sglang-router: where the config asks for them
    out = Path(cfg.output_dir)
    check_output_paths(cfg, out)  # where the run writes, before anything is written
    check_model_dir(cfg.model.path)  # a missing directory, weights or tokenizer: said now, before any loading
    latest = latest_checkpoint(out / "checkpoints") if cfg.trainer.resume else None
    resume_notes = check_resume(out, cfg, latest) if latest is not None else []
    for prefix, path in cfg.reward.custom.items():
        try:
            register_reward_path(prefix, path)
        except (ImportError, AttributeError, ValueError) as err:  # a typo in the reference, or its module's own
            raise ConfigError(f"reward.custom.{prefix}={path!r}: {err}") from None
    agent = agent_from_config(cfg)  # an unknown tool or parser: said now
    # rows that would stop the run when reached (data.on_bad_row=error) or be skipped, an unknown data_source or
    # reward_metric, a judge-scored row without reward.judge
    routes = check_reward_data([*cfg.data.train_files, *cfg.data.val_files], judge_configured(cfg.reward.judge),
                               on_bad_row=cfg.data.on_bad_row)
    return CheckedRun(out, latest, resume_notes, agent, routes)


def check_output_paths(cfg: RunConfig, out: Path) -> None:
    """ConfigError naming the first directory of the run (output_dir, its checkpoints/, its hf/ when
    trainer.save_hf) that it could not write in; nothing is left behind by the check."""
    paths = [("output_dir", out), ("output_dir (its checkpoints)", out / "checkpoints")]
    if cfg.trainer.save_hf:
        paths.append(("trainer.save_hf (the model's export)", out / "hf"))
    for key, path in paths:
        problem = unwritable(path)
        if problem is not None:
            raise ConfigError(f"{key}: cannot write {path}: {problem}")


def unwritable(path: Path) -> str | None:
    """Why `path` cannot be a directory to write in (None when it can): it, or the nearest of its parents that
    exists, is not a directory, or no file can be made there (tried: a temporary directory, removed)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    try:
        with tempfile.TemporaryDirectory(prefix=".rl360-write-check-", dir=existing):
            pass
    except OSError as err:
        return f"nothing can be created in {existing} ({err.strerror or err})"
    return None
