"""Run one function as N torch.distributed ranks, each in its own process on this host.

`run_ranks("package.module:function", world_size, args)` starts `python -m rl360.cluster.launch` once per
rank with RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, waits for all of them, and
raises naming every failed rank with the tail of its output. If one rank fails the others are stopped,
so a collective that can never complete does not hang the caller. The function receives the string
arguments and calls `init_parallel` itself. On a host with a GPU for every rank, rank i takes GPU i (NCCL);
with fewer (NCCL refuses two ranks of a group on one GPU) the ranks see none and run on the CPU over gloo.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rl360.network import free_port


class RankFailed(RuntimeError):
    """One or more ranks exited with an error."""


def run_ranks(target: str, world_size: int, args: list[str], timeout_s: float | None = None,
              threads_per_rank: int | None = None) -> None:
    """Run `target(*args)` on `world_size` ranks and wait; `RankFailed` if any rank fails or time runs out."""
    port = str(free_port())
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    devices = {} if _gpus_here() >= world_size else {"CUDA_VISIBLE_DEVICES": ""}
    with tempfile.TemporaryDirectory(prefix="rl360-ranks-") as logs:
        procs = []
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS=str(threads), **devices)
            log = open(Path(logs) / f"rank{rank}.log", "wb")  # noqa: SIM115  (closed below)
            procs.append((subprocess.Popen([sys.executable, "-m", "rl360.cluster.launch", target, *args], env=env,
                                           stdout=log, stderr=subprocess.STDOUT), log))
        failed = _wait_all([proc for proc, _ in procs], timeout_s)
        for _, log in procs:
            log.close()
        if failed:
            tails = "\n".join(f"--- rank {rank} (exit {code}):\n{_tail(Path(logs) / f'rank{rank}.log')}"
                              for rank, code in failed)
            raise RankFailed(f"{target} failed on rank(s) {[rank for rank, _ in failed]}:\n{tails}")


def _gpus_here() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _wait_all(procs: list[subprocess.Popen], timeout_s: float | None) -> list[tuple[int, int | str]]:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while any(proc.poll() is None for proc in procs):
        bad = [proc for proc in procs if proc.poll() not in (None, 0)]
        late = deadline is not None and time.monotonic() > deadline
        if bad or late:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            for proc in procs:
                proc.wait()
            if late and not bad:
                return [(rank, f"killed after {timeout_s} s") for rank in range(len(procs))]
            break
        time.sleep(0.05)
    return [(rank, proc.returncode) for rank, proc in enumerate(procs) if proc.returncode != 0]


def _tail(path: Path, chars: int = 3000) -> str:
    text = path.read_text(errors="replace")
    return text[-chars:]


def _main() -> None:
    module, _, name = sys.argv[1].partition(":")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    getattr(importlib.import_module(module), name)(*sys.argv[2:])


if __name__ == "__main__":  # the guard matters: dist_checkpointing's save spawns a process that re-imports main
    _main()
