"""A real multi-host run on one machine: three network namespaces are the nodes (tests/netns_cluster.py), and
`launchers/slurm/ray_cluster.sh` brings Ray up over them as it does over a Slurm allocation, with the namespace
runner in place of srun. Each node offers Ray one CPU, so the policy's two data-parallel ranks must land on
two nodes; the rollout engines serve from the nodes Ray puts them on. Needs root (skipped otherwise).

- the quickstart trains across the nodes and learns (last-5 reward >= 0.8), rank 0 anywhere (torch.distributed's
  store follows it), the trainer on the head, every node joined and torn down at the end;
- a worker node lost mid-run (every process on it SIGKILLed, or `ray stop --force` on it) ends the job within
  DEADLINE_S, non-zero, with a message naming the node.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rl360.cluster.groups import WorkerGroup
from rl360.errors import STOPPED_EXIT
from tests.netns_cluster import NetnsCluster

REPO = Path(__file__).resolve().parent.parent
BRING_UP = REPO / "launchers" / "slurm" / "ray_cluster.sh"
# of the quickstart's 400 steps: its last 40-step reward windows here read 0.84 0.87 0.93 from step 160 on (seed 0),
# so the last 5 of 280 clear the bar with room
STEPS = 280
RUN_TIMEOUT_S = 1800  # about 4 minutes on 2 free CPU cores
DEADLINE_S = 60  # a lost node ends the job within this long (measured: 5 to 10 s on 2 cores)
PLACED = re.compile(r"^policy: 2 ranks on 2 nodes: rank 0 on (\S+) \((\S+)\), rank 1 on (\S+) \((\S+)\)$", re.M)

pytestmark = pytest.mark.slow


def _require_namespaces() -> None:
    """Skip unless this process may make network namespaces (root, and a kernel and container that allow it)."""
    if os.geteuid() != 0:
        pytest.skip(f"network namespaces need root; this test runs as uid {os.geteuid()}")
    probe = "rl360-probe"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)  # an interrupted run's
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"`ip netns add` fails here: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def _venv() -> str:
    """The environment every node activates (a login shell on a node resets PATH, as on a real cluster)."""
    if not (Path(sys.prefix) / "bin" / "activate").exists():
        pytest.fail(f"run the tests from a virtualenv (.venv/bin/python -m pytest): {sys.prefix} has no bin/activate")
    return sys.prefix


@dataclass
class Job:
    """One bring-up run: its exit status, wall time, output (bring-up and trainer), and which processes each
    node held while it ran (command lines, sampled every few seconds)."""

    returncode: int
    wall_s: float
    output: str
    out_dir: Path
    seen: dict[str, set[str]] = field(default_factory=dict)

    def metrics(self) -> list[dict]:
        path = self.out_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def nodes_running(self, marker: str) -> set[str]:
        return {node for node, commands in self.seen.items() if any(marker in c for c in commands)}


class BringUp:
    """`ray_cluster.sh -- rl360 quickstart ...` over `cluster`'s nodes, output in a file (never a pipe: a process
    left behind on a node must not hold the test)."""

    def __init__(self, cluster: NetnsCluster, work: Path, steps: int):
        self.cluster, self.work = cluster, work
        self.out_dir, self.log = work / "out", work / "job.log"
        assets = work / "assets"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RL360_", "SLURM_", "RAY_"))}
        env.update(RL360_NODES=" ".join(cluster.nodes), RL360_ON_NODE=cluster.on_node, RL360_VENV=_venv(),
                   RL360_GPUS_PER_NODE="0", RL360_CPUS_PER_NODE="1", RL360_LOG_DIR=str(work / "logs"),
                   RL360_READY_TIMEOUT_S="180")
        command = [str(BRING_UP), "--", "rl360", "quickstart", f"output_dir={self.out_dir}",
                   f"model.path={assets / 'model'}", f"data.train_files=[{assets / 'data' / 'train.parquet'}]",
                   "cluster.ray_address=auto", "rollout.engine=server", "rollout.num_engines=2",
                   "rollout.engine_hosts=ray", "actor.parallel.data=2", "trainer.num_threads=1",
                   f"trainer.total_steps={steps}"]
        self.started = time.monotonic()
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        self.seen: dict[str, set[str]] = {node: set() for node in cluster.nodes}

    def sample(self) -> None:
        for node in self.cluster.nodes:
            self.seen[node].update(self.cluster.processes(node))

    def steps_done(self) -> int:
        path = self.out_dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def wait(self, timeout_s: float) -> Job:
        """Sample the nodes until the job ends; at `timeout_s` kill it and fail."""
        deadline = self.started + timeout_s
        while self.process.poll() is None:
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"the job did not end within {timeout_s:g} s; its output:\n{self.output()[-6000:]}")
            self.sample()
            time.sleep(3)
        return Job(self.process.returncode, time.monotonic() - self.started, self.output(), self.out_dir, self.seen)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, 9)
            self.process.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def cluster():
    _require_namespaces()
    with NetnsCluster(prefix="rl360-n", subnet="10.77.0") as made:
        yield made


@pytest.fixture(scope="module")
def quickstart(cluster, tmp_path_factory):
    """The quickstart across the three nodes, once for every test below it."""
    job = BringUp(cluster, tmp_path_factory.mktemp("multihost"), STEPS)
    try:
        finished = job.wait(RUN_TIMEOUT_S)
    finally:
        job.stop()
    print(f"multi-host quickstart: exit {finished.returncode} in {finished.wall_s:.0f} s")
    return finished


def test_the_quickstart_learns_across_the_nodes(quickstart):
    assert quickstart.returncode == 0, quickstart.output[-6000:]
    rewards = [m["reward/mean"] for m in quickstart.metrics()]
    assert len(rewards) == STEPS
    last5 = sum(rewards[-5:]) / 5
    print(f"first 5 steps {sum(rewards[:5]) / 5:.3f}, last 5 {last5:.3f}, wall {quickstart.wall_s:.0f} s")
    assert last5 >= 0.8


def test_the_policy_ranks_ran_on_two_nodes(quickstart, cluster):
    placed = PLACED.search(quickstart.output)
    assert placed, quickstart.output[-6000:]
    rank0, address0, rank1, address1 = placed.groups()
    assert rank0 != rank1 and {rank0, rank1} <= set(cluster.nodes)
    assert (cluster.addresses[rank0], cluster.addresses[rank1]) == (address0, address1)
    # what the nodes themselves held, not only what the trainer said
    assert quickstart.nodes_running("ray::PolicyWorker") == {rank0, rank1}


def test_the_engines_served_from_the_nodes_ray_placed_them_on(quickstart, cluster):
    engines = json.loads((quickstart.out_dir / "rollout" / "engines.json").read_text())
    node_of = {address: node for node, address in cluster.addresses.items()}
    engine_nodes = {node_of[engine["node"]] for engine in engines}  # a KeyError: an engine outside the cluster
    assert len(engines) == 2 and all(engine["url"].startswith(f"http://{engine['node']}:") for engine in engines)
    assert quickstart.nodes_running("rl360.engine.server") == engine_nodes
    placed = PLACED.search(quickstart.output)
    print(f"policy ranks on {placed.group(1)} and {placed.group(3)}; engines on {sorted(engine_nodes)}")


def test_every_node_joined_the_trainer_ran_on_the_head_and_nothing_is_left(quickstart, cluster):
    assert "ray cluster ready: 3 node(s)" in quickstart.output
    assert quickstart.nodes_running("rl360 quickstart") == {cluster.nodes[0]}
    assert quickstart.nodes_running("raylet") == set(cluster.nodes)
    deadline = time.monotonic() + 30
    while any(len(cluster.pids(node)) > 2 for node in cluster.nodes) and time.monotonic() < deadline:
        time.sleep(1)  # ray stop's SIGKILLs take a moment
    left = {node: [c for c in cluster.processes(node) if "netns_cluster" not in c and "unshare" not in c
                   and not c.startswith(sys.executable + " -c")] for node in cluster.nodes}
    assert left == {node: [] for node in cluster.nodes}


@pytest.mark.parametrize("how", ["killed", "ray-stop"])
def test_a_lost_worker_node_ends_the_job_naming_it(how, tmp_path):
    _require_namespaces()
    with NetnsCluster(prefix="rl360-k", subnet="10.77.1") as lossy:
        job = BringUp(lossy, tmp_path, STEPS)
        try:
            while job.steps_done() < 3:  # training across the nodes; then a worker holding a policy rank goes
                assert job.process.poll() is None, job.output()[-6000:]
                assert time.monotonic() - job.started < RUN_TIMEOUT_S / 3, job.output()[-6000:]
                time.sleep(1)
            job.sample()
            victim = next(node for node in lossy.nodes[1:] if node in {
                n for n, commands in job.seen.items() if any("ray::PolicyWorker" in c for c in commands)})
            lost_at = time.monotonic()
            if how == "killed":
                lossy.kill(victim)
            else:
                subprocess.run([*lossy.on_node.replace("{node}", victim).split(), "bash", "-c",
                                f"source {_venv()}/bin/activate && ray stop --force"], capture_output=True,
                               timeout=DEADLINE_S)
            while job.process.poll() is None and time.monotonic() - lost_at < DEADLINE_S:
                time.sleep(0.2)
            ended_s = time.monotonic() - lost_at
            output = job.output()
        finally:
            job.stop()
    print(f"{how} {victim}: the job ended {ended_s:.1f} s later with status {job.process.returncode}")
    assert ended_s < DEADLINE_S, f"still running {DEADLINE_S} s after {victim} was lost:\n{output[-6000:]}"
    assert job.process.returncode != 0
    assert f"the ray node on {victim} exited" in output and f"node {victim} is down or lost its Ray" in output, \
        output[-6000:]


def test_a_dead_rank_is_named_with_its_node(tmp_path):
    """Without namespaces: a rank whose process dies fails the group's next call with its rank and node."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        group = WorkerGroup(_Echo, 2, name="echoes", distributed=True)
        assert group.call("master") == [(ray.util.get_node_ip_address(), group.call("master")[0][1])] * 2
        ray.kill(group.actors[1])  # takes effect asynchronously: a call made just after may still be answered
        deadline = time.monotonic() + 60
        while True:
            try:
                group.call("master")
            except RuntimeError as err:
                assert re.match(r"echoes rank 1 on node \S+ \([\d.]+\) died: ", str(err)), str(err)
                break
            assert time.monotonic() < deadline, "rank 1 still answers 60 s after ray.kill"
            time.sleep(0.2)
        group.shutdown()
    finally:
        ray.shutdown()


class _Echo:
    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int):
        self.master_addr, self.master_port = master_addr, master_port

    def master(self) -> tuple[str, int]:
        return self.master_addr, self.master_port


def test_the_time_limit_warning_reaches_the_command_and_the_job_ends_stopped(tmp_path):
    """SIGUSR1 to the job script (Slurm's `--signal=B:USR1@300` goes to the batch shell only) is passed on to the
    command on the head node, under the trainer's own handlers (tests/stop_waiter.py), which stops with its line
    and status 75; the script then stops Ray on the node and ends with that status (no SLURM_JOB_ID: no requeue)."""
    _require_namespaces()
    log = tmp_path / "job.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RL360_", "SLURM_", "RAY_"))}
    with NetnsCluster(size=1, prefix="rl360-s", subnet="10.77.2") as single:
        env.update(RL360_NODES=" ".join(single.nodes), RL360_ON_NODE=single.on_node, RL360_VENV=_venv(),
                   RL360_GPUS_PER_NODE="0", RL360_CPUS_PER_NODE="1", RL360_LOG_DIR=str(tmp_path / "logs"),
                   RL360_READY_TIMEOUT_S="180")
        with open(log, "w") as out:
            job = subprocess.Popen([str(BRING_UP), "--", "python", "-m", "tests.stop_waiter", str(tmp_path), "finish"],
                                   cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while not re.search(r"^child \d+$", log.read_text(), re.MULTILINE):  # the command waits
                assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.5)
            job.send_signal(signal.SIGUSR1)
            assert job.wait(timeout=120) == STOPPED_EXIT, log.read_text()[-4000:]
            left = single.processes(single.nodes[0])
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
    output = log.read_text()
    assert "rl360 launch: SIGUSR1: the job is near its time limit; stopping the command" in output
    assert f"rl360: stopped by SIGUSR1 at step 7; checkpoint {tmp_path / 'step_000007'}" in output
    assert "rl360 launch: stopping ray on 1 node(s)" in output and "requeue" not in output
    ours = ("raylet", "gcs_server", "ray::", "stop_waiter", "sleep 1000")
    assert not [command for command in left if any(name in command for name in ours)], left
