"""Metrics to the console, to `<output_dir>/metrics.jsonl` (one JSON object per step) and to the trackers asked
for (wandb, swanlab, TensorBoard: rl360/tracking/backends.py).

A console line: `step 12/100  elapsed 1:05  eta 7:10  reward=...`: elapsed since the run started, the estimate
from this process's steps after its first (whose time includes start-up), or from the first's own time alone.
Step 0 (held-out metrics before training, `validation.before_train`) is logged like a step, without an ETA."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from rl360.tracking.backends import Backend, open_backend
from rl360.tracking.console import format_duration

CONSOLE_KEYS = {  # metric -> its label on the console line
    "reward/mean": "reward", "response_length/mean": "resp_len", "actor/pg_loss": "pg_loss",
    "actor/kl": "kl", "actor/grad_norm": "grad_norm", "rollout/logprob_abs_diff": "logprob_diff",
    "reward/timeouts": "timeouts", "sft/loss": "loss", "val/loss": "val_loss", "sft/grad_norm": "grad_norm",
    "sft/tokens_per_s": "tokens_per_s", "timing/step_s": "step_s",
}


class Tracker:
    def __init__(self, output_dir: str | Path, config: dict[str, Any], use_wandb: bool = False,
                 project: str = "rl360", run_name: str = "", log_every: int = 1,
                 console: TextIO | None = None, resume_after_step: int | None = None,
                 total_steps: int | None = None, started: float | None = None, use_swanlab: bool = False,
                 use_tensorboard: bool = False):
        """`console`: where step lines go (None: sys.stdout at each line); `started`: time.monotonic() when the
        run started (None: now); `resume_after_step`: the checkpoint's step a resumed run continues from."""
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_after_step is not None and self.path.exists():  # steps after the checkpoint are re-run
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_after_step]
        self._file = self.path.open("w")
        self._file.write("".join(line + "\n" for line in kept))
        self._console = console
        self.total_steps = total_steps
        self._started = time.monotonic() if started is None else started
        self._step_ends: list[tuple[int, float]] = []  # (step, time.monotonic()) of this process's steps
        self._first_step_s = 0.0
        self.log_every = log_every
        asked = {"wandb": use_wandb, "swanlab": use_swanlab, "tensorboard": use_tensorboard}
        self._backends: list[Backend] = []
        try:
            for name in (name for name, wanted in asked.items() if wanted):
                self._backends.append(open_backend(name, output_dir, config, project, run_name, resume_after_step))
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for backend in self._backends:
            backend.log(step, record)
        now = time.monotonic()
        if step > 0:  # step 0 (an evaluation before training) times no step
            if not self._step_ends:
                self._first_step_s = float(record.get("timing/step_s") or now - self._started)
            self._step_ends.append((step, now))
        if step % self.log_every == 0 or step == self.total_steps:
            shown = "  ".join(f"{label}={_fmt(record[key])}" for key, label in CONSOLE_KEYS.items() if key in record)
            print(f"{self._progress(step, now)}  {shown}", file=self._console or sys.stdout, flush=True)

    def _progress(self, step: int, now: float) -> str:
        """`step k/N  elapsed E  eta T` (`step k` with no total)."""
        if not self.total_steps:
            return f"step {step:>4}  elapsed {format_duration(now - self._started)}"
        width = len(str(self.total_steps))
        text = f"step {step:>{width}}/{self.total_steps}  elapsed {format_duration(now - self._started)}"
        if not self._step_ends:  # step 0: no step timed yet
            return text
        return f"{text}  eta {format_duration(self.seconds_per_step() * max(0, self.total_steps - step))}"

    def seconds_per_step(self) -> float:
        """Mean time of this process's steps after its first; the first's own (its `timing/step_s`) while it is
        the only one."""
        (first_step, first_end), (last_step, last_end) = self._step_ends[0], self._step_ends[-1]
        if last_step > first_step:
            return (last_end - first_end) / (last_step - first_step)
        return self._first_step_s

    def close(self) -> None:
        self._file.close()
        for backend in self._backends:
            backend.close()
        self._backends = []


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
