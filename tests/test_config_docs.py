"""docs/config.md and docs/from_verl.md are generated from rl360/config.py (`python -m rl360.config_docs`):
the committed files equal the output, every key of RunConfig is in the reference with its help, and every
verl key rl360 knows is in the verl table."""

import dataclasses
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from rl360.config import VERL_KEYS, RunConfig
from rl360.config_docs import SAME_NAMES, config_keys, render_config, render_verl

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _every_key(node, prefix=""):
    for key, value in node.items():
        if OmegaConf.is_dict(value) and dataclasses.is_dataclass(OmegaConf.get_type(value)):
            yield from _every_key(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def test_committed_docs_are_the_generated_ones():
    assert (DOCS / "config.md").read_text() == render_config(), "python -m rl360.config_docs config > docs/config.md"
    assert (DOCS / "from_verl.md").read_text() == render_verl(), "python -m rl360.config_docs verl > docs/from_verl.md"


def test_every_key_of_run_config_is_in_the_reference_with_its_help():
    keys = list(_every_key(OmegaConf.structured(RunConfig)))
    assert len(keys) > 100 and [key for key, *_ in config_keys()] == keys
    text = (DOCS / "config.md").read_text()
    for key, _kind, _default, help_text in config_keys():
        assert f"| `{key}` | " in text, key
        assert help_text, f"{key} has no comment in rl360/config.py"
    row = next(line for line in text.splitlines() if line.startswith("| `model.min_pixels` |"))
    assert row == ("| `model.min_pixels` | int | `0` | vision-language models: bounds on each image's resized area in "
                   "pixels (0: the model's image processor's own) |")  # a comment above two fields covers both
    assert "| `rollout.colocate` | bool \\| None | `null` |" in text


def test_every_verl_key_is_in_the_verl_table():
    text = (DOCS / "from_verl.md").read_text()
    for key in VERL_KEYS:
        assert f"| `{key}` | " in text, key
    assert "| `data.train_batch_size` | `data.batch_size` |" in text
    assert "| `actor_rollout_ref.actor.optim.lr` | `actor.lr` |" in text
    assert "| `actor_rollout_ref.rollout.n` | `rollout.n` |" in text
    assert "| `trainer.total_epochs` | rl360 counts steps, not epochs" in text
    keys = {key for key, *_ in config_keys()}
    assert set(SAME_NAMES) <= keys and all(f"`{name}`" in text for name in SAME_NAMES)
    for target in VERL_KEYS.values():  # a mapping names a real key (else it is a sentence)
        first = target.split(" ", 1)[0]
        if "." in first and first.islower() and first.replace(".", "").replace("_", "").isalnum():
            assert first in keys, target


def test_the_generator_runs_as_a_module():
    done = subprocess.run([sys.executable, "-m", "rl360.config_docs", "verl"], capture_output=True, text=True,
                          timeout=120, cwd=DOCS.parent)
    assert done.returncode == 0 and done.stdout == render_verl()
