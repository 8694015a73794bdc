"""Stopping a training run cleanly: SIGINT (Ctrl-C), SIGTERM (`kill`, `timeout`, Slurm at a time limit or a
preemption) and SIGUSR1 (Slurm's warning before a time limit, `#SBATCH --signal=B:USR1@300`).

The first such signal asks the run to stop at its next safe point: the step in progress ends (or, when rollouts
are not drawn ahead, the rollout in progress is abandoned: a resumed run draws it again, the same), a checkpoint
of the last completed step is written, every process the run started is stopped, and the command prints one line,
`rl360: stopped by SIGTERM at step 37; checkpoint outputs/x/checkpoints/step_000037; run the same command to
resume`, and exits with `STOPPED_EXIT`. At a terminal the signal is also acknowledged at once (`rl360: SIGINT:
stopping at the next safe point ...`), since the safe point can be a step away; in a log (Slurm's, `timeout`'s)
the stop line is the only one. A second signal stops at once: one line naming the last checkpoint written, the
run's processes killed, the same status.

A signal that comes while the command is still starting (reading its config, importing the trainer) is held
(`hold_early_signals`, the command line's first step) and taken by the run as soon as its handlers are installed:
the run stops before its first step.

    stop = StopSignals(checkpoints_dir)   # installs the handlers (again after ray.init: Ray replaces SIGTERM's)
    stop.requested                        # a signal came: stop at the next safe point
    stop.wait_for(future)                 # the future's result, or None when a signal comes first
    raise stop.stopped(step, checkpoint)  # RunStopped: the command line prints its line, exits STOPPED_EXIT
    stop.uninstall()

The handler itself only records the signal and wakes a watcher thread through a pipe (a handler that took a lock
could deadlock on one its own thread holds); the thread prints the acknowledgement and releases the waits.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from rl360.errors import STOPPED_EXIT, RunStopped

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
_held: list[str] = []  # the stop signals that came before a run installed its handlers, by name


def hold_early_signals() -> None:
    """Until a run installs `StopSignals`, a stop signal is held instead of ending the process (SIGUSR1's default)
    or raising KeyboardInterrupt in an import: the run takes it when it starts. A second one ends the process at
    once, with one line."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, _hold)


def _hold(signum: int, frame: Any) -> None:
    _held.append(signal.Signals(signum).name)
    if len(_held) > 1:
        os.write(2, f"rl360: stopped at once by a second signal ({_held[-1]}) before the run started\n".encode())
        kill_descendants()
        os._exit(STOPPED_EXIT)


_DEFAULTS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL, signal.SIGUSR1: signal.SIG_DFL}


class StopSignals:
    """SIGINT, SIGTERM and SIGUSR1 handlers for a run (main thread only; elsewhere they are not installed and
    `requested` stays False). `checkpoints`: the run's checkpoint directory, named by a stop at once."""

    def __init__(self, checkpoints: Path):
        self.checkpoints = checkpoints
        self.signal_name: str | None = None
        self._requested: concurrent.futures.Future = concurrent.futures.Future()
        self._previous: dict[int, Any] = {}
        self._read, self._write = os.pipe()
        threading.Thread(target=self._watch, name="rl360-stop-signals", daemon=True).start()
        self.install()
        if _held:  # one came while the command was starting
            self._handle(signal.Signals[_held.pop()].value, None)

    @property
    def requested(self) -> bool:
        return self._requested.done()

    def install(self) -> None:
        """(Re)install the handlers; the ones found the first time are restored by `uninstall`."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, _DEFAULTS[sig] if previous is _hold else previous)

    def uninstall(self) -> None:
        """Restore the handlers found at the first install; the watcher thread ends."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
        if self.signal_name is None:
            os.write(self._write, b".")  # wakes the watcher to end without a stop
        os.close(self._write)

    def wait_for(self, future: concurrent.futures.Future) -> Any:
        """`future.result()`, or None as soon as a stop is requested (at once if one already was)."""
        concurrent.futures.wait([future, self._requested], return_when=concurrent.futures.FIRST_COMPLETED)
        return None if self.requested else future.result()

    def stopped(self, step: int, checkpoint: Path | None, note: str = "") -> RunStopped:
        return RunStopped(self.signal_name or "a signal", step, checkpoint, note)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal_name is not None:
            self._stop_at_once(signal.Signals(signum).name)
        self.signal_name = signal.Signals(signum).name
        os.write(self._write, b"!")

    def _watch(self) -> None:
        woken = os.read(self._read, 1)
        os.close(self._read)
        if woken != b"!":
            return
        if not sys.stdout.isatty():  # a log: the stop line is the one line
            self._requested.set_result(None)
            return
        print(f"rl360: {self.signal_name}: stopping at the next safe point with a checkpoint (another signal "
              "stops at once)", flush=True)
        self._requested.set_result(None)

    def _stop_at_once(self, name: str) -> None:
        """A second signal: the line, every process this one started killed, exit (from the handler)."""
        latest = _latest(self.checkpoints)
        saved = f"checkpoint {latest} (the last one written)" if latest else "no checkpoint yet"
        line = f"rl360: stopped at once by a second signal ({name}); {saved}; run the same command to " \
               f"{'resume' if latest else 'start again'}\n"
        os.write(2, line.encode())
        kill_descendants()
        os._exit(STOPPED_EXIT)


def kill_descendants(grace_s: float = 0.0) -> None:
    """End every live descendant of this process (engines and reward workers in sessions of their own included:
    they are still its descendants): SIGTERM, and SIGKILL for those still there `grace_s` seconds later (at once
    when 0)."""
    import psutil

    try:
        alive = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for send in (["terminate"] if grace_s > 0 else []) + ["kill"]:
        for child in alive:
            try:
                getattr(child, send)()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(alive, timeout=grace_s if send == "terminate" else 10)


def _latest(checkpoints: Path) -> Path | None:
    """The checkpoint `latest` (rl360.checkpointing.LATEST) names, read without checking it (from a signal
    handler: no exception)."""
    try:
        return checkpoints / (checkpoints / "latest").read_text().strip()
    except OSError:
        return None
