"""A real Slurm on this machine for tests: Debian's `munged`, `slurmctld` and one `slurmd` (packages `munge` and
`slurm-wlm`, installed by `.ci/run`), all under a temporary directory with their own key, socket, ports and
state, so nothing of the machine's own configuration is read or changed. One node, named after the host, with the
machine's CPUs and memory, in a partition `debug`; jobs run as the user who runs the tests (root: Slurm's daemons
need it). Completed jobs stay visible to `scontrol show job` for an hour (no accounting database: `sacct` needs
slurmdbd). slurmd, and so every job, runs in a PID namespace of its own (`unshare --pid --mount-proc`): a job's
`ray stop --force` (the templates' bring-up and teardown, as on a cluster's exclusive node) then sees and stops
the job's own Ray processes only, not those of other tests running beside it.

    with SlurmCluster(tmp_path) as slurm:
        env = slurm.env()                       # SLURM_CONF for sbatch, squeue, scontrol, scancel
        slurm.job(job_id)                       # `scontrol show job` as a dict: JobState, Restarts, ExitCode ...
        slurm.wait_for(job_id, lambda job: job["JobState"] == "COMPLETED", timeout_s=600)
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from tests.up_down import UpDown

DAEMONS = ("munged", "slurmctld", "slurmd")


def missing() -> str | None:
    """Why a Slurm cannot be started here, or None."""
    absent = [name for name in DAEMONS if shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin") is None]
    if absent:
        return f"{', '.join(absent)} not installed (apt-get install slurm-wlm munge; .ci/run does)"
    if os.geteuid() != 0:
        return "Slurm's daemons run as root here"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024 - 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


class SlurmCluster(UpDown):
    def __init__(self, root: Path):
        self.root = root
        self.node = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge.socket"
        self._started: list[tuple[str, Path]] = []  # (daemon, pid file)
        self._slurmd: subprocess.Popen | None = None  # `unshare ... slurmd -D`: the node's PID namespace

    def env(self, **extra: str) -> dict[str, str]:
        path = os.environ.get("PATH", "")
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": f"{path}:/usr/sbin", **extra}

    def up(self) -> None:
        root = self.root
        (root / "state").mkdir(parents=True, exist_ok=True)
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._daemon("munged", root / "munged.pid", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                     f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'munged.log'}",
                     f"--seed-file={root / 'munged.seed'}")
        self.conf.write_text(self._config())
        self._daemon("slurmctld", root / "slurmctld.pid", "-i")
        self._slurmd_in_own_pid_namespace()
        self.wait_for_node_idle()

    def _slurmd_in_own_pid_namespace(self) -> None:
        """slurmd in the foreground as the first process of a new PID namespace (with its own /proc); when slurmd
        ends, every process left in the namespace is killed, and when `unshare` is killed, slurmd gets SIGTERM."""
        binary = shutil.which("slurmd", path=self.env()["PATH"])
        with open(self.root / "slurmd.out", "w") as out:
            self._slurmd = subprocess.Popen(
                ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM", binary, "-D", "-N", self.node],
                env=self.env(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)

    def _config(self) -> str:
        root = self.root
        return "\n".join([
            "ClusterName=rl360test",
            "GresTypes=gpu",  # GPUs are a resource jobs may ask for (this node has none: `--gpus-per-node=0`)
            f"SlurmctldHost={self.node}(127.0.0.1)",
            "SlurmUser=root", "SlurmdUser=root",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge", f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'slurmctld.log'}", f"SlurmdLogFile={root / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "SchedulerType=sched/backfill",
            "ReturnToService=2", "JobRequeue=1", "MinJobAge=3600", "KillWait=30",
            # containers and VMs report CPUs and memory Slurm would otherwise hold against the node's own line
            "SlurmdParameters=config_overrides",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={_memory_mb()} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ])

    def _daemon(self, name: str, pid_file: Path, *args: str) -> None:
        binary = shutil.which(name, path=self.env()["PATH"])
        done = subprocess.run([binary, *args], env=self.env(), capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{name} did not start (status {done.returncode}): {done.stderr.strip()}")
        self._started.append((name, pid_file))

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(list(command), env=self.env(), capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: status {done.returncode}: {done.stderr.strip()}")
        return done

    def wait_for_node_idle(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip()
            if state == "idle":
                return
            time.sleep(0.5)
        raise RuntimeError(f"node {self.node} not idle after {timeout_s} s (sinfo: {state!r}); "
                           f"slurmd.log: {self.log('slurmd')[-2000:]}")

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o` as key -> value."""
        line = self.run("scontrol", "show", "job", "-o", job_id).stdout.strip()
        return dict(field.split("=", 1) for field in line.split() if "=" in field)

    def wait_for(self, job_id: str, condition: Callable[[dict[str, str]], bool], timeout_s: float,
                 what: str = "") -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if condition(job):
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id}: {what or 'condition'} not met in {timeout_s} s: {job}")
            time.sleep(1)

    def log(self, daemon: str) -> str:
        path = self.root / f"{daemon}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def down(self) -> None:
        """Cancel what is still queued, then stop the daemons (slurmd, slurmctld, munged) and wait for them."""
        if any(name == "slurmctld" for name, _ in self._started):
            self.run("scancel", "--full", "--user", "root", check=False)
        self._stop_slurmd()
        for _, pid_file in reversed(self._started):
            try:
                pid = int(pid_file.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            try:
                os.kill(pid, 15)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
                time.sleep(0.2)
        self._started = []

    def _stop_slurmd(self) -> None:
        """SIGTERM to slurmd itself (`unshare` ignores it while it waits), then wait for it and its namespace."""
        if self._slurmd is None:
            return
        if self._slurmd.poll() is None:
            for child in psutil.Process(self._slurmd.pid).children():
                child.terminate()
            try:
                self._slurmd.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._slurmd.kill()  # slurmd gets SIGTERM again (--kill-child), the namespace's rest SIGKILL with it
                self._slurmd.wait(timeout=30)
        self._slurmd = None
