"""Metrics to the console, to `<output_dir>/metrics.jsonl` (one JSON object per step) and to wandb."""

from __future__ import annotations

import json
import math
import os
import sys
import uuid
from pathlib import Path
from typing import Any, TextIO

CONSOLE_KEYS = {  # metric -> its label on the console line
    "reward/mean": "reward", "response_length/mean": "resp_len", "actor/pg_loss": "pg_loss",
    "actor/kl": "kl", "actor/grad_norm": "grad_norm", "rollout/logprob_abs_diff": "logprob_diff",
    "reward/timeouts": "timeouts", "timing/step_s": "step_s",
}


class Tracker:
    def __init__(self, output_dir: str | Path, config: dict[str, Any], use_wandb: bool = False,
                 project: str = "rl360", run_name: str = "", log_every: int = 1,
                 console: TextIO = sys.stdout, resume_after_step: int | None = None):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_after_step is not None and self.path.exists():  # steps after the checkpoint are re-run
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_after_step]
        self._file = self.path.open("w")
        self._file.write("".join(line + "\n" for line in kept))
        self._console = console
        self.log_every = log_every
        self._wandb = None
        if use_wandb:
            import wandb  # imported only when asked for

            self._wandb = wandb.init(
                project=project, name=run_name or Path(output_dir).name, config=config,
                dir=str(Path(output_dir)), mode=os.environ.get("WANDB_MODE"),
                id=_wandb_run_id(Path(output_dir), resumed=resume_after_step is not None), resume="allow",
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None and step >= self._wandb.step:  # a resumed online run has its earlier steps
            self._wandb.log(record, step=step)
        if step % self.log_every == 0:
            shown = "  ".join(f"{label}={_fmt(record[key])}" for key, label in CONSOLE_KEYS.items() if key in record)
            print(f"step {step:>4}  {shown}", file=self._console, flush=True)

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def _wandb_run_id(output_dir: Path, resumed: bool) -> str:
    """The wandb run id of this output directory: a resumed run continues the same wandb run, a fresh
    run (same directory, no resume) starts a new one. Kept in `<output_dir>/wandb_run_id`."""
    path = output_dir / "wandb_run_id"
    if resumed and path.exists():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:16]
    path.write_text(run_id + "\n")
    return run_id


def _plain(value: Any) -> float | int | str | None:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)
