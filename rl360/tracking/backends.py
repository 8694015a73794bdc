"""Where a run's metrics go besides metrics.jsonl and the console: wandb, swanlab and TensorBoard, each behind
one small interface (`log(step, record)`, `close()`), each package imported only when its backend is asked for.

    backend = open_backend("tensorboard", output_dir, config, project="rl360", run_name="", resumed_from=None)
    backend.log(3, {"step": 3, "reward/mean": 0.5})
    backend.close()

Resume (`resumed_from`: the checkpoint's step): wandb continues the same run (its id kept in
`<output_dir>/wandb_run_id`) and skips the steps it already has; TensorBoard drops its events after the
checkpoint's step (`purge_step`), so the re-run steps are not shown twice; swanlab (offline) writes a new run
file under `<output_dir>/swanlab/` holding the steps after the checkpoint.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from pathlib import Path
from typing import Any, Protocol

from rl360.errors import UserError

# backend -> (module imported, pip package)
PACKAGES = {"wandb": ("wandb", "wandb"), "swanlab": ("swanlab", "swanlab"),
            "tensorboard": ("torch.utils.tensorboard", "tensorboard")}


class TrackerPackageMissing(UserError):
    """A tracker was asked for whose package is not installed."""

    label = "config error"


class Backend(Protocol):
    def log(self, step: int, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def missing_package(name: str) -> str | None:
    """The one-line message for `tracking.<name>=true` when its package is not installed (None: installed)."""
    module, package = PACKAGES[name]
    root = "tensorboard" if name == "tensorboard" else module  # torch.utils.tensorboard imports tensorboard
    if importlib.util.find_spec(root) is None:
        return f"tracking.{name}=true needs the {package} package: pip install {package}"
    return None


def open_backend(name: str, output_dir: str | Path, config: dict[str, Any], project: str = "rl360",
                 run_name: str = "", resumed_from: int | None = None) -> Backend:
    problem = missing_package(name)
    if problem:
        raise TrackerPackageMissing(problem)
    output_dir = Path(output_dir)
    run_name = run_name or output_dir.name
    return {"wandb": WandbBackend, "swanlab": SwanlabBackend, "tensorboard": TensorBoardBackend}[name](
        output_dir, config, project, run_name, resumed_from)


class WandbBackend:
    def __init__(self, output_dir: Path, config: dict[str, Any], project: str, run_name: str,
                 resumed_from: int | None):
        import wandb

        self._run = wandb.init(project=project, name=run_name, config=config, dir=str(output_dir),
                               mode=os.environ.get("WANDB_MODE"),
                               id=_wandb_run_id(output_dir, resumed=resumed_from is not None), resume="allow")

    def log(self, step: int, record: dict[str, Any]) -> None:
        if step >= self._run.step:  # a resumed online run has its earlier steps
            self._run.log(record, step=step)

    def close(self) -> None:
        self._run.finish()


class SwanlabBackend:
    """swanlab's offline mode: the run's records in `<output_dir>/swanlab/run-*/run-*.swanlab`
    (`swanlab sync DIR` uploads one later); numbers only."""

    def __init__(self, output_dir: Path, config: dict[str, Any], project: str, run_name: str,
                 resumed_from: int | None):
        import swanlab

        self._run = swanlab.init(project=project, name=run_name, config=config, mode="offline",
                                 log_dir=str(output_dir / "swanlab"), reinit=True)

    def log(self, step: int, record: dict[str, Any]) -> None:
        numbers = _numbers(record)
        if numbers:
            self._run.log(numbers, step=step)

    def close(self) -> None:
        self._run.finish()


class TensorBoardBackend:
    """Event files in `<output_dir>/tensorboard/` (`tensorboard --logdir <output_dir>/tensorboard`); numbers only."""

    def __init__(self, output_dir: Path, config: dict[str, Any], project: str, run_name: str,
                 resumed_from: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(output_dir / "tensorboard"),
                                     purge_step=None if resumed_from is None else resumed_from + 1)

    def log(self, step: int, record: dict[str, Any]) -> None:
        for key, value in _numbers(record).items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric metrics (not its `step`, strings or missing values)."""
    return {key: float(value) for key, value in record.items() if key != "step" and isinstance(value, int | float)}


def _wandb_run_id(output_dir: Path, resumed: bool) -> str:
    """The wandb run id of this output directory: a resumed run continues the same wandb run, a fresh
    run (same directory, no resume) starts a new one. Kept in `<output_dir>/wandb_run_id`."""
    path = output_dir / "wandb_run_id"
    if resumed and path.exists():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:16]
    path.write_text(run_id + "\n")
    return run_id
