"""`rl360 launch` through a real Slurm (tests/slurm_cluster.py: Debian's munged, slurmctld and slurmd on this
machine): the 1-node template, with its cluster-sized settings set back to the quickstart's tiny run
(tests/fixtures/configs/template_to_tiny.yaml, configs/quickstart.yaml), is submitted with sbatch; the job brings
Ray up and runs `rl360 train` through srun. Slurm's time-limit warning (`scancel --signal=USR1 --batch`, what
`#SBATCH --signal=B:USR1@300` sends) stops the run with a checkpoint, the job requeues itself, and the requeued job
resumes and ends exactly as the unbroken run of tests/resume_runs.py (same metrics, same weights).

The job's bring-up stops stale Ray processes on its node (`ray stop --force`), as on a cluster's exclusive node:
here that is this machine, so Ray clusters of other test runs going on beside this one are stopped too.
"""

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests import slurm_cluster
from tests.killing import title
from tests.resume_runs import REPO, TOTAL_STEPS, _assert_same_metrics, _assert_same_weights, _records, run_overrides
from tests.slurm_cluster import SlurmCluster, _free_port

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(slurm_cluster.missing() is not None, reason=str(slurm_cluster.missing()))]

TEMPLATE = "configs/templates/qwen2.5-7b-1node.yaml"
TO_TINY = ["tests/fixtures/configs/template_to_tiny.yaml", "configs/quickstart.yaml", "data.mix_weights={}"]
WARN_AFTER_STEP = 4
JOB_TIMEOUT_S = 900


@dataclass
class Job:
    id: str
    out: Path
    submitted: str  # what `rl360 launch` printed
    log: str  # the job's --output file (both runs: --open-mode=append)
    states: list[str]  # the JobState values seen, in order, each once
    final: dict[str, str]  # `scontrol show job` at the end
    left: list[str]  # processes still carrying the job's id 30 s after it completed


def _job_processes(job_id: str) -> list[str]:
    """Live processes whose environment holds SLURM_JOB_ID=job_id (Ray's, the trainer's, the engines'), as
    `PID COMMAND`, once none is left or 30 s have passed."""
    deadline = time.monotonic() + 30
    while (left := _with_job_id(job_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return [f"{pid} {title(pid)}" for pid in left]


def _with_job_id(job_id: str) -> list[int]:
    found = []
    marker = f"SLURM_JOB_ID={job_id}".encode()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0"):
                    if Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def preempted(slurm, assets, tmp_path_factory) -> Job:
    """The template's job submitted by `rl360 launch`, warned by Slurm after step WARN_AFTER_STEP, requeued, resumed
    and run to its end."""
    work = tmp_path_factory.mktemp("slurm-job")
    out = work / "run"
    env = slurm.env(RL360_VENV=sys.prefix, RL360_GPUS_PER_NODE="0", RL360_MODEL_PATH=str(assets / "model"),
                    RL360_DATA_DIR=str(assets), RL360_RAY_PORT=str(_free_port()),
                    RL360_RAY_DASHBOARD_PORT=str(_free_port()), RL360_LOG_DIR=str(work / "ray-logs"))
    launch = subprocess.run(  # sbatch options (replacing the template's GPUs, CPUs, log and time), then the run's
        [sys.executable, "-m", "rl360.cli", "launch", TEMPLATE,
         "--gpus-per-node=0", f"--cpus-per-task={os.cpu_count()}", f"--output={work}/job-%j.out", "--time=30",
         *TO_TINY, *run_overrides(assets, out, "grpo", f"trainer.save_every={TOTAL_STEPS}")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert launch.returncode == 0, launch.stderr
    job_id = re.fullmatch(r"Submitted batch job (\d+)\n", launch.stdout).group(1)
    states: list[str] = []

    def seen(job: dict[str, str]) -> dict[str, str]:
        if not states or states[-1] != job["JobState"]:
            states.append(job["JobState"])
        return job

    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not (out / "metrics.jsonl").exists() or len(_records(out)) < WARN_AFTER_STEP:
            job = seen(slurm.job(job_id))
            assert job["JobState"] in ("PENDING", "RUNNING"), (job, _read(work, job_id))
            assert time.monotonic() < deadline, _read(work, job_id)
            time.sleep(0.5)
        slurm.run("scancel", "--signal=USR1", "--batch", job_id)  # Slurm's warning before the time limit
        slurm.wait_for(job_id, lambda job: seen(job)["Restarts"] == "1" and job["JobState"] == "PENDING",
                       JOB_TIMEOUT_S, "requeued")
        # Slurm holds a requeued batch job about two minutes before it may start again; a test lifts the hold
        # once the node has let the first run go and a second has passed (slurmd refuses a job whose credential
        # is no newer, by its one-second clock, than the revocation of the first run's)
        slurm.wait_for_node_idle()
        time.sleep(2)
        slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        final = slurm.wait_for(job_id, lambda job: seen(job)["JobState"] not in ("PENDING", "RUNNING",
                                                                                   "REQUEUED", "COMPLETING"),
                               JOB_TIMEOUT_S, "ended")
    finally:
        slurm.run("scancel", job_id, check=False)
    return Job(job_id, out, launch.stdout, _read(work, job_id), states, final, _job_processes(job_id))


def _read(work: Path, job_id: str) -> str:
    log = work / f"job-{job_id}.out"
    return log.read_text(errors="replace") if log.exists() else f"(no {log})"


def test_the_job_runs_through_sbatch_and_srun_to_completion(preempted, slurm):
    job = preempted
    assert job.final["JobState"] == "COMPLETED" and job.final["ExitCode"] == "0:0", (job.final, job.log[-4000:])
    assert job.final["Restarts"] == "1" and job.final["Requeue"] == "1"
    assert job.states[:2] == ["PENDING", "RUNNING"] or job.states[0] == "RUNNING", job.states
    assert "PENDING" in job.states[1:] and job.states[-1] == "COMPLETED", job.states
    bring_ups = re.findall(rf"rl360 launch: 1 node\(s\) x 0 GPU\(s\); ray head on {slurm.node} ", job.log)
    assert len(bring_ups) == 2, job.log[-4000:]  # the first run and the requeued one
    assert f"done: metrics in {job.out / 'metrics.jsonl'}" in job.log
    assert job.left == []  # Ray, the trainer and its engines ended with the job


def test_the_warning_stops_the_run_with_a_checkpoint_and_the_job_requeues(preempted):
    job = preempted
    (line,) = re.findall(r"rl360: stopped by SIGUSR1 at step \d+; checkpoint \S+; run the same command to resume",
                         job.log)
    step = int(re.search(r"at step (\d+)", line).group(1))
    assert WARN_AFTER_STEP <= step < TOTAL_STEPS
    assert f"checkpoint {job.out / 'checkpoints' / f'step_{step:06d}'};" in line
    assert "rl360 launch: SIGUSR1: the job is near its time limit; stopping the command" in job.log
    assert f"rl360 launch: requeueing job {job.id}" in job.log
    assert f"resumed from {job.out / 'checkpoints' / f'step_{step:06d}'} at step {step + 1}" in job.log
    assert "Traceback" not in job.log, job.log[-4000:]


def test_the_requeued_job_ends_as_the_unbroken_run(preempted, unbroken):
    reference = unbroken["grpo"]
    assert [r["step"] for r in _records(preempted.out)] == list(range(1, TOTAL_STEPS + 1))  # each step once
    _assert_same_metrics(preempted.out, reference.out)
    _assert_same_weights(preempted.out / "hf", reference.out / "hf")


def test_the_template_with_the_tiny_settings_is_the_quickstart_run(preempted, unbroken):
    """The config the job ran equals the unbroken quickstart run's but for where it writes, Ray's address (the
    job's cluster) and how it was told to start and track."""
    ours = yaml.safe_load((preempted.out / "config.yaml").read_text())
    theirs = yaml.safe_load((unbroken["grpo"].out / "config.yaml").read_text())
    assert ours["cluster"]["ray_address"] == "auto"
    for config in (ours, theirs):
        config.pop("output_dir")
        config["cluster"].pop("ray_address")
        config["trainer"].pop("resume")
        config.pop("tracking")
    assert json.dumps(ours, sort_keys=True) == json.dumps(theirs, sort_keys=True)
