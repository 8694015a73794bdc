"""A signal stops a run cleanly: SIGTERM to `rl360 train` (what `kill`, `timeout` and Slurm send) and SIGINT to its
whole process group (what Ctrl-C in a terminal sends) end the run at its next safe point with a checkpoint of the
last step completed, one line naming the step and the checkpoint, exit status 75 and no process left; the same
command then resumes and ends exactly as the unbroken run of tests/test_resume.py (shared: tests/resume_runs.py).
A second signal stops at once. SIGUSR1 (Slurm's warning before a time limit) and the second signal are shown on a
small process using the same handlers (tests/stop_waiter.py), beside a child in a session of its own as the
engines are.
"""

import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from rl360.errors import STOPPED_EXIT
from tests.killing import TrainingProcess, session_pids
from tests.resume_runs import (
    REPO,
    RUN_TIMEOUT_S,
    TOTAL_STEPS,
    _assert_same_metrics,
    _assert_same_weights,
    _command,
    _finish,
    _records,
)

_STOP_LINE = re.compile(r"rl360: stopped by (\w+) at step (\d+); checkpoint (\S+); run the same command to resume")


def _ctrl_c(pid: int) -> None:
    os.killpg(pid, signal.SIGINT)  # a terminal's Ctrl-C: every process of the foreground group


# how each run is stopped, and after which logged step
STOPS = {"SIGTERM": (lambda pid: os.kill(pid, signal.SIGTERM), 3), "SIGINT": (_ctrl_c, 7)}


@dataclass
class Stopped:
    out: Path
    code: int
    output: str
    left: list[str]  # processes of the run still alive after it exited
    resumed_output: str


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _stop_and_resume(assets: Path, name: str) -> Stopped:
    send, after = STOPS[name]
    out = assets / f"stopped-{name}"
    command = _command(assets, out, "grpo", f"trainer.save_every={TOTAL_STEPS}")
    run = TrainingProcess(command, cwd=str(REPO))
    try:
        run.wait_for_step(after)
        started = psutil.Process(run.proc.pid).children(recursive=True)
        send(run.proc.pid)
        code = run.wait(RUN_TIMEOUT_S)
        left = [f"{p.pid} {p.name()}" for p in started if _alive(p)] + [str(pid) for pid in session_pids(run.proc.pid)]
    finally:
        run.kill_everything()
    resumed = TrainingProcess(command, cwd=str(REPO))
    _finish({name: resumed})
    return Stopped(out, code, run.output, left, resumed.output)


@pytest.fixture(scope="module")
def stopped(assets) -> dict[str, Stopped]:
    """One run per signal (both at once), stopped and then resumed to its end."""
    with ThreadPoolExecutor(len(STOPS)) as pool:
        futures = {name: pool.submit(_stop_and_resume, assets, name) for name in STOPS}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", STOPS)
def test_a_signal_stops_the_run_with_a_checkpoint_and_one_line(stopped, name):
    run = stopped[name]
    assert run.code == STOPPED_EXIT, run.output[-3000:]
    assert "Traceback" not in run.output and "KeyboardInterrupt" not in run.output, run.output[-3000:]
    lines = run.output.splitlines()
    (line,) = [line for line in lines if line.startswith("rl360: stopped")]
    assert line == lines[-1]
    signal_name, step, checkpoint = _STOP_LINE.fullmatch(line).groups()
    step = int(step)
    assert signal_name == name and STOPS[name][1] <= step < TOTAL_STEPS
    assert Path(checkpoint) == run.out / "checkpoints" / f"step_{step:06d}"
    assert (run.out / "checkpoints" / "latest").read_text() != ""  # the resumed run has moved it on since
    assert "stopping at the next safe point" not in run.output  # not a terminal: the stop line is the one line
    assert run.left == []
    assert f"resumed from {checkpoint} at step {step + 1}" in run.resumed_output
    log = (run.out / "train.log").read_text()
    assert line in log.splitlines()


@pytest.mark.slow
@pytest.mark.parametrize("name", STOPS)
def test_a_stopped_run_resumes_and_ends_as_the_unbroken_run(stopped, unbroken, name):
    run, reference = stopped[name], unbroken["grpo"]
    assert [r["step"] for r in _records(run.out)] == list(range(1, TOTAL_STEPS + 1))  # each step logged once
    _assert_same_metrics(run.out, reference.out)
    _assert_same_weights(run.out / "hf", reference.out / "hf")


# ---- the handlers on a small process ------------------------------------------------------------------------

def _waiter(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.stop_waiter", str(tmp_path), mode], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline().split()[1])
    return proc, child


def test_sigusr1_stops_at_the_safe_point_with_one_line(tmp_path):
    proc, child = _waiter(tmp_path, "finish")
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == STOPPED_EXIT
    assert out.splitlines() == ["stopping"]
    assert err.splitlines() == [f"rl360: stopped by SIGUSR1 at step 7; checkpoint {tmp_path / 'step_000007'}; run "
                                "the same command to resume"]
    assert not psutil.pid_exists(child)


def test_at_a_terminal_the_signal_is_acknowledged_at_once(tmp_path):
    """Ctrl-C at a terminal: the stop can be a step away, so the signal is answered at once, then the stop line."""
    import pty

    primary, secondary = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "tests.stop_waiter", str(tmp_path), "finish"], cwd=REPO,
                            stdout=secondary, stderr=subprocess.PIPE, text=True)
    os.close(secondary)
    with os.fdopen(primary, "r", errors="replace") as terminal:
        assert terminal.readline().startswith("child ")
        proc.send_signal(signal.SIGINT)
        assert terminal.readline().rstrip("\r\n") == ("rl360: SIGINT: stopping at the next safe point with a "
                                                      "checkpoint (another signal stops at once)")
        assert terminal.readline().rstrip("\r\n") == "stopping"
    assert proc.wait(timeout=60) == STOPPED_EXIT
    assert proc.stderr.read().startswith("rl360: stopped by SIGINT at step 7")


def test_a_signal_while_the_command_starts_stops_the_run_before_its_first_step(tmp_path):
    """SIGUSR1's default action ends a process: one that comes while `rl360 train` still imports its modules is
    held, and the run stops as soon as it has started, with its one line."""
    proc = subprocess.Popen([sys.executable, "-c", "import os, signal, sys\n"
                             "from rl360.stopping import hold_early_signals\n"
                             "hold_early_signals()\n"
                             "os.kill(os.getpid(), signal.SIGUSR1)  # before the run's handlers\n"
                             "sys.argv = ['stop_waiter', sys.argv[1], 'finish']\n"
                             "from tests.stop_waiter import main\n"
                             "from rl360.errors import run_command\n"
                             "sys.exit(run_command(main, sys.argv[1:]))", str(tmp_path)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == STOPPED_EXIT, err
    assert err.splitlines() == [f"rl360: stopped by SIGUSR1 at step 7; checkpoint {tmp_path / 'step_000007'}; run "
                                "the same command to resume"]


def test_a_second_signal_stops_at_once_and_ends_every_process_started(tmp_path):
    (tmp_path / "latest").write_text("step_000004\n")
    proc, child = _waiter(tmp_path, "hang")
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline() == "stopping\n"  # now in the long checkpoint
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == STOPPED_EXIT
    assert err.splitlines() == [f"rl360: stopped at once by a second signal (SIGTERM); checkpoint "
                                f"{tmp_path / 'step_000004'} (the last one written); run the same command to resume"]
    assert not _alive_pid(child)


def _alive_pid(pid: int) -> bool:
    try:
        return _alive(psutil.Process(pid))
    except psutil.Error:
        return False
