"""A signal stops a run cleanly: SIGTERM to `rl360 train` (what `kill`, `timeout` and Slurm send) and SIGINT to its
whole process group (what Ctrl-C in a terminal sends) end the run at its next safe point with a checkpoint of the
last step completed, one line naming the step and the checkpoint, exit status 75 and no process left; the same
command then resumes and ends exactly as the unbroken run. The runs are tests/resume_runs.py's interrupted GRPO
(SIGTERM) and PPO (Ctrl-C) runs, which tests/test_resume.py then kills in each phase.
A second signal stops at once. SIGUSR1 (Slurm's warning before a time limit) and the second signal are shown on a
small process using the same handlers (tests/stop_waiter.py), beside a child in a session of its own as the
engines are.
"""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from rl360.errors import STOPPED_EXIT
from tests.resume_runs import REPO, STOPS, TOTAL_STEPS, _alive, _assert_same_metrics, _assert_same_weights, _records

_STOP_LINE = re.compile(r"rl360: stopped by (\w+) at step (\d+); checkpoint (\S+); run the same command to resume")


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", STOPS)
def test_a_signal_stops_the_run_with_a_checkpoint_and_one_line(killed, algorithm):
    run, (name, _, after) = killed[algorithm], STOPS[algorithm]
    stop = run.stop
    assert stop.code == STOPPED_EXIT, stop.output[-3000:]
    assert "Traceback" not in stop.output and "KeyboardInterrupt" not in stop.output, stop.output[-3000:]
    lines = stop.output.splitlines()
    (line,) = [line for line in lines if line.startswith("rl360: stopped")]
    assert line == lines[-1]
    signal_name, step, checkpoint = _STOP_LINE.fullmatch(line).groups()
    step = int(step)
    assert signal_name == name and after <= step < TOTAL_STEPS
    assert Path(checkpoint) == run.out / "checkpoints" / f"step_{step:06d}"
    assert "stopping at the next safe point" not in stop.output  # not a terminal: the stop line is the one line
    assert stop.left == []
    assert f"resumed from {checkpoint} at step {step + 1}" in stop.next_output
    log = (run.out / "train.log").read_text()
    assert line in log.splitlines()


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", STOPS)
def test_a_stopped_run_resumes_and_ends_as_the_unbroken_run(killed, unbroken, algorithm):
    """(Killed too after the stop: tests/test_resume.py checks each kill.)"""
    run, reference = killed[algorithm], unbroken[algorithm]
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
