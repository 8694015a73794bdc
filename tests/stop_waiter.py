"""A process that waits as the trainer waits for a rollout, under the trainer's signal handlers, beside a child in a
session of its own (as the engines are): `python -m tests.stop_waiter CHECKPOINTS MODE`. It prints `child PID`,
then waits for a future that never completes; a stop signal ends the wait, it prints `stopping` and, in MODE
"hang", waits on as a long checkpoint would (a second signal ends it), else raises the stop: the command line's
line and status. For tests/test_stopping.py and tests/test_launch.py."""

import concurrent.futures
import subprocess
import sys
import threading
from pathlib import Path

from rl360.errors import run_command
from rl360.stopping import StopSignals


def main(args: list[str]) -> int:
    checkpoints, mode = Path(args[0]), args[1]
    stop = StopSignals(checkpoints)
    child = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    print(f"child {child.pid}", flush=True)
    if stop.wait_for(concurrent.futures.Future()) is not None:
        raise AssertionError("a future that never completes returned")
    print("stopping", flush=True)
    if mode == "hang":
        threading.Event().wait()
    child.kill()
    child.wait()
    raise stop.stopped(7, checkpoints / "step_000007")


if __name__ == "__main__":
    sys.exit(run_command(main, sys.argv[1:]))
