"""Run `rl360 train` as a process tree, kill it with SIGKILL inside a chosen phase of its work, and prove
which phase the kill landed in.

Ray names every actor process after the method it is running (`ray::HFEngine.generate`,
`ray::PolicyWorker.update`, `ray::PolicyWorker.save_checkpoint`, plain `ray::PolicyWorker` when idle), so
the phases of a run can be watched from outside through /proc: the trainer needs no hook for tests. The
run is started in a session of its own; Ray's processes, the reward workers and the checkpoint writer
processes all stay in it. A kill waits for the phase, sleeps a (seeded, random) delay, freezes the whole
session with SIGSTOP, reads the titles again and kills only if the phase is still running; when it ended
during the delay the run goes on (SIGCONT) and the next occurrence of the phase is tried, with a shorter
delay. The titles seen while frozen are the proof of where the kill landed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PHASES = {
    "rollout": re.compile(r"ray::HFEngine\.generate\b"),
    "update": re.compile(r"ray::PolicyWorker\.update\b"),
    "checkpoint": re.compile(r"ray::(Policy|Critic)Worker\.save_checkpoint\b"),
    "sft_update": re.compile(r"ray::SFTWorker\.update\b"),  # `rl360 sft`'s optimizer step
}
_STEP_LINE = re.compile(r"step\s+(\d+)[/\s]")  # `step 3/12  ...` (or `step 3  ...`)
POLL_S = 0.002


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name: [state, ppid, pgrp, session, ...], None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session `sid`."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def title(pid: int) -> str:
    """The process's command line as it shows it (Ray rewrites it to name the running method)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@dataclass
class Kill:
    """Where a kill landed: the phase aimed at, the first step it was aimed at (the console can lag a line:
    the output directory tells the step exactly), the random delay after the phase was seen, how many
    occurrences were tried, and the titles of the run's Ray processes while it was frozen."""

    phase: str
    aimed_step: int
    delay_s: float
    tries: int
    titles: list[str]

    @property
    def landed_in_phase(self) -> bool:
        return any(PHASES[self.phase].search(t) for t in self.titles)


@dataclass
class TrainingProcess:
    """`command` running in its own session; its console is read as it comes (`lines`, `logged_step`)."""

    command: list[str]
    cwd: str | None = None
    lines: list[str] = field(default_factory=list)
    logged_step: int = 0  # the last `step N` line printed

    def __post_init__(self):
        self._new_line, self._output_ended = threading.Condition(), False
        self.proc = subprocess.Popen(self.command, cwd=self.cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._new_line:
                self.lines.append(line)
                if match := _STEP_LINE.match(line):
                    self.logged_step = int(match.group(1))
                self._new_line.notify_all()
        with self._new_line:
            self._output_ended = True
            self._new_line.notify_all()

    def wait_for_step(self, step: int, timeout_s: float = 300) -> None:
        """Wait until the run has printed its `step N` line for `step` (AssertionError if it ends first)."""
        with self._new_line:
            if not self._new_line.wait_for(lambda: self.logged_step >= step or self._output_ended,
                                           timeout=timeout_s) or self.logged_step < step:
                raise AssertionError(f"the run did not reach step {step}:\n{self.output[-3000:]}")

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=10)
        return code

    def _phase_running(self, phase: str, workers: list[int]) -> bool:
        return any(PHASES[phase].search(title(pid)) for pid in workers)

    def _workers(self) -> list[int]:
        """The session's Ray actor processes (where the phases show)."""
        return [pid for pid in session_pids(self.proc.pid) if title(pid).startswith("ray::")]

    def kill_in(self, phase: str, step: int, delay_s: float, timeout_s: float = 300) -> Kill:
        """SIGKILL the whole session while `phase` runs, at its first occurrence in step `step` or later
        that is still running `delay_s` (a quarter of it at the next occurrence, ...) after it was seen."""
        deadline = time.monotonic() + timeout_s
        tries, workers, refreshed = 0, [], 0.0
        while True:
            # wait for the phase, in the step asked for (a checkpoint belongs to the step just logged)
            while True:
                if self.proc.poll() is not None:
                    raise AssertionError(f"the run ended before {phase} of step {step}:\n{self.output[-3000:]}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"no {phase} of step {step} within {timeout_s}s:\n{self.output[-3000:]}")
                if time.monotonic() - refreshed > 0.2:  # actors (and checkpoint writers) come and go
                    workers, refreshed = self._workers(), time.monotonic()
                current = self.logged_step + (0 if phase == "checkpoint" else 1)
                if current >= step and self._phase_running(phase, workers):
                    break
                time.sleep(POLL_S)
            tries += 1
            delay = delay_s / 4 ** (tries - 1)
            time.sleep(delay)
            frozen = self._freeze([self.proc.pid, *workers])
            titles = [title(pid) for pid in frozen]
            if any(PHASES[phase].search(t) for t in titles):
                self._kill(frozen)
                return Kill(phase, step, delay, tries, sorted(t for t in titles if t.startswith("ray::")))
            _signal_all(frozen, signal.SIGCONT)
            while self.proc.poll() is None and self._phase_running(phase, self._workers()):
                time.sleep(POLL_S)  # let this occurrence end: the next try is the next occurrence

    def _freeze(self, first: list[int] = ()) -> list[int]:
        """SIGSTOP every process of the session, `first` first (a scan of /proc takes milliseconds), then
        any other, including any started while stopping the others."""
        _signal_all(list(first), signal.SIGSTOP)
        frozen: set[int] = set(first)
        while new := set(session_pids(self.proc.pid)) - frozen:
            _signal_all(sorted(new), signal.SIGSTOP)
            frozen |= new
        return sorted(frozen)

    def _kill(self, pids: list[int]) -> None:
        """SIGKILL them all, then wait until the session has no live process left."""
        _signal_all(pids, signal.SIGKILL)
        self.wait(timeout_s=60)
        deadline = time.monotonic() + 60
        while left := session_pids(self.proc.pid):
            _signal_all(left, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise AssertionError(f"processes {left} of the killed run are still alive")
            time.sleep(0.05)

    def kill_everything(self) -> None:
        """Clean-up after a failed test: no process of the run may outlive it."""
        if self.proc.poll() is None or session_pids(self.proc.pid):
            self._kill(self._freeze())
