"""The config saved with each run (`<output_dir>/config.yaml`), and what a resumed run may change of it.

A run writes the config it was given (every key, defaults filled in) to `config.yaml` before it starts. A run
that resumes from a checkpoint first compares its config with the saved one, key by key:
- changes the checkpoint cannot take are refused, before Ray starts, in one line naming each key with its old
  and new value (`REFUSED`: the parameter dtype, the model, the optimizer's kind, a critic added or dropped);
- every other change resumes and is printed (`resume: actor.lr 0.0005 -> 0.0001`), the parallel layout
  included: checkpoints are megatron distributed checkpoints, loadable at any TP x PP x CP x DP x VP layout;
- keys that do not shape the training (`IGNORED`: how long, how often to save, where to log) are not reported.
A run that starts over moves the previous run's files aside (`rl360.checkpointing.set_previous_run_aside`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rl360.config import AlgorithmConfig, ConfigError, RunConfig, to_dict

CONFIG_FILE = "config.yaml"

# key -> why a checkpoint cannot resume under another value
REFUSED = {
    "model.dtype": "the checkpoint's weights and optimizer state are in the old dtype",
    "model.path": "the checkpoint holds weights of the old model",
    "actor.distributed_optimizer": "the two optimizers keep their state in different forms",
}
# prefixes of keys that never matter for resuming (a key equal to one, or below it)
IGNORED = ("output_dir", "trainer.total_steps", "trainer.resume", "trainer.save_every", "trainer.keep_checkpoints",
           "trainer.save_hf", "trainer.memory_check", "trainer.num_threads", "trainer.dump_rollouts_every", "tracking",
           "cluster")


def save_run_config(output_dir: str | Path, cfg: RunConfig) -> Path:
    """Write `cfg` as YAML to `<output_dir>/config.yaml`; its path."""
    path = Path(output_dir) / CONFIG_FILE
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path


def saved_run_config(output_dir: str | Path) -> dict[str, Any] | None:
    """The config a run saved in `output_dir`, as nested dicts; None when it saved none."""
    path = Path(output_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        saved = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML ({str(err).splitlines()[0]}): restore it, or set "
                          "trainer.resume=false to start over") from None
    return saved if isinstance(saved, dict) else None


def resume_changes(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(refused, allowed): `key old -> new` for each key whose value differs between the saved config and this
    run's (both as `to_dict` gives them), keys in `IGNORED` left out; a key the saved config lacks (written by
    another version) is not compared."""
    sections = to_dict(RunConfig())
    old, new = _flatten(saved, sections), _flatten(current, sections)
    refused, allowed = [], []
    for key, value in new.items():
        if key not in old or old[key] == value or _ignored(key):
            continue
        change = f"{key} {_show(old[key])} -> {_show(value)}"
        if key in REFUSED:
            refused.append(f"{change} ({REFUSED[key]})")
        elif key == "algorithm.adv_estimator" and _has_critic(old[key]) != _has_critic(value):
            refused.append(f"{change} (the checkpoint {'holds a' if _has_critic(old[key]) else 'has no'} critic; "
                           f"this run {'needs one' if _has_critic(value) else 'has none'})")
        else:
            allowed.append(change)
    return refused, allowed


def check_resume(output_dir: str | Path, cfg: RunConfig, checkpoint: Path) -> list[str]:
    """Compare this run's config with the one saved in `output_dir` before resuming from `checkpoint`: a
    ConfigError naming every change it cannot take; else one `resume: key old -> new` line per change."""
    saved = saved_run_config(output_dir)
    if saved is None:
        return [f"resume: {Path(output_dir) / CONFIG_FILE} not found: config changes since {checkpoint.name} are "
                "not checked"]
    refused, allowed = resume_changes(saved, to_dict(cfg))
    if refused:
        raise ConfigError(f"cannot resume {checkpoint} with this config: {'; '.join(refused)}. Set the old value "
                          "back, or trainer.resume=false to start over (the old run is moved aside)")
    return [f"resume: {change}" for change in allowed]


def _flatten(tree: dict[str, Any], sections: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a.b": value}` for the config's sections (`sections`: the default config's tree); a key whose value
    is a mapping (reward.custom, data.mix_weights) is one value."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        section = sections.get(key)
        if isinstance(value, dict) and isinstance(section, dict) and section:
            flat.update(_flatten(value, section, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return flat


def _ignored(key: str) -> bool:
    return any(key == prefix or key.startswith(prefix + ".") for prefix in IGNORED)


def _has_critic(estimator: Any) -> bool:
    return isinstance(estimator, str) and AlgorithmConfig(adv_estimator=estimator).uses_critic


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value or '""'
    return str(value)
