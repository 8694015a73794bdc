"""Sandboxed code cannot read the trainer's or a reward worker's environment through /proc.

Each scenario runs a stand-in trainer: a fresh Python process started with a secret in its environment
(so the secret is in its /proc/<pid>/environ, in its reward forkserver's, and in the start-up block every
worker inherits) that opens a real `RewardPool` with a second secret in the pool's `env` (read from its
stdin, so it is in the workers' environment only) and scores one row of `test_snoop`. That reward runs
SNOOP in the sandbox, exactly as `codegen` runs a response's code: it reads its own environment,
/proc/<ppid>/environ (the worker), /proc/1/environ and every /proc/*/environ and /proc/*/cmdline it can
list, and prints what it read. The row scores 1 when neither secret appears in that output.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from rl360.rewards import register_reward
from rl360.rewards.remote_sandbox import run_python_code
from rl360.rewards.sandbox import isolation

REPO = Path(__file__).resolve().parents[1]
TRAINER_SECRET = "trainer-secret-7f3a9c"  # in the stand-in trainer's environment
POOL_SECRET = "pool-secret-51be02"  # in the pool's env= (the reward workers' environment)
SNOOP = r"""
import json, os
read, refused = {"os.environ": json.dumps(dict(os.environ))}, {}
try:
    pids = sorted(name for name in os.listdir("/proc") if name.isdigit())
except OSError:
    pids = []
paths = [f"/proc/{os.getppid()}/environ", "/proc/1/environ"]
paths += [f"/proc/{pid}/{name}" for pid in pids for name in ("environ", "cmdline")]
for path in dict.fromkeys(paths):
    try:
        with open(path, "rb") as handle:
            read[path] = handle.read().decode("utf-8", "replace")
    except OSError as err:
        refused[path] = type(err).__name__
print(json.dumps({"ppid": os.getppid(), "read": read, "refused": refused}))
"""
TRAINER = """
import json, sys
import tests.test_sandbox_secrets
from rl360.rewards import RewardItem, RewardPool

pool_secret = sys.stdin.read()  # neither in this process's environment nor on its command line
report = {}
for name, env in (("default", {}), ("forced_none", {"RL360_SANDBOX_ISOLATION": "none"})):
    with RewardPool(num_workers=1, timeout_s=60, env={"RL360_TEST_POOL_SECRET": pool_secret, **env}) as pool:
        [result] = pool.score([RewardItem("test_snoop", "", "")])
        found = pool.sandbox_isolation()
        report[name] = {"score": result.score, "error": result.error, "extras": result.extras,
                        "worker": pool._workers[0].process.pid, "summary": found.summary(),
                        "in_effect": found.in_effect}
        if name == sys.argv[1]:
            break
print(json.dumps(report))
"""


@register_reward("test_snoop")
def snoop(solution_str, ground_truth, extra_info=None):
    """Runs SNOOP in the sandbox; 1.0 when neither secret is in what it read. Extras: the paths it read and
    could not read, the ones where a secret appeared (`leaks`), its parent pid, and which secrets this
    worker's own environment holds (`worker_has`)."""
    worker_env = json.dumps(dict(os.environ))
    worker_has = [name for name, secret in (("trainer", TRAINER_SECRET), ("pool", POOL_SECRET)) if secret in worker_env]
    result = run_python_code(SNOOP)
    if not result.ok:
        return {"score": 0.0, "failure": result.error or result.stderr[-500:], "worker_has": worker_has}
    seen = json.loads(result.stdout)
    leaks = sorted(path for path, text in seen["read"].items() if TRAINER_SECRET in text or POOL_SECRET in text)
    return {"score": float(not leaks and TRAINER_SECRET not in result.stdout and POOL_SECRET not in result.stdout),
            "leaks": leaks, "read": sorted(seen["read"]), "refused": seen["refused"], "ppid": seen["ppid"],
            "worker_has": worker_has}


def as_nobody_python() -> tuple[list[str], str]:
    """A command prefix that runs Python as the user nobody (setpriv), and the PYTHONPATH it needs: this
    interpreter when nobody may run it, else the system's python3 of the same version with this one's
    packages (a virtualenv under /root is out of nobody's reach). Skips the test when there is neither."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv")
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    version = f"import sys; assert sys.version_info[:2] == {tuple(sys.version_info[:2])!r}"
    packages = sysconfig.get_paths()["purelib"]
    for python in dict.fromkeys([sys.executable, "/usr/local/bin/python3", "/usr/bin/python3"]):
        try:  # the child itself must be able to start this interpreter again (the forkserver does)
            check = subprocess.run([*prefix, python, "-c", f"import subprocess, sys; {version}; "
                                    "subprocess.run([sys.executable, '-c', ''], check=True)"],
                                   env={"PATH": os.environ["PATH"], "PYTHONPATH": packages}, cwd="/",
                                   capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if check.returncode == 0:
            return [*prefix, python], os.pathsep.join([str(REPO), packages])
    pytest.skip("no Python interpreter that the user nobody can run")


def _trainer(last: str, as_nobody: bool = False, **env: str) -> tuple[dict, str]:
    """Run the stand-in trainer (as the user nobody, or as this user) until scenario `last`; its report and
    output."""
    command, path = as_nobody_python() if as_nobody else ([sys.executable], str(REPO))
    environ = {"PATH": os.environ["PATH"], "HOME": "/tmp", "PYTHONPATH": path, "RL360_TEST_SECRET": TRAINER_SECRET,
               **env}
    done = subprocess.run([*command, "-c", TRAINER, last], env=environ, cwd="/tmp", input=POOL_SECRET,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1]), done.stdout + done.stderr


@pytest.mark.skipif(not isolation().complete, reason="this machine cannot fully isolate sandboxed code")
def test_sandboxed_code_reads_no_secret_and_refuses_to_run_without_isolation():
    report, output = _trainer("forced_none")
    isolated, refused = report["default"], report["forced_none"]
    assert isolated["error"] is None and isolated["score"] == 1.0, isolated
    worker = isolated["worker"]
    assert isolated["extras"]["worker_has"] == ["pool"]  # the worker's allow-list kept the trainer's secret out
    assert isolated["extras"]["ppid"] == worker  # it tried the worker's environment: hidden from it
    assert isolated["extras"]["refused"][f"/proc/{worker}/environ"] == "FileNotFoundError"
    assert "/proc/1/environ" not in isolated["extras"]["read"]
    assert isolated["summary"].startswith("rl360 sandbox: untrusted code runs isolated: ")
    # without isolation (required by default) nothing runs: a counted error, no leak
    assert refused["score"] == 0.0 and refused["error"].startswith("IsolationError: refusing to run untrusted code")
    assert "missing: uid (turned off by RL360_SANDBOX_ISOLATION='none')" in refused["summary"]
    assert TRAINER_SECRET not in output and POOL_SECRET not in output


def test_without_a_uid_of_its_own_the_worker_stays_unreadable_to_the_code():
    """The fallback a non-root user accepts with reward.require_isolation=false: the code runs as the
    trainer's user. The worker (non-dumpable) keeps its environment, and the pool's secret with it. With
    namespaces, which come from a user namespace here, no process outside it is readable at all; without
    them the trainer's own environment would be: the start-up line says what is missing ("uid")."""
    report, output = _trainer("forced_none", as_nobody=True, RL360_SANDBOX_REQUIRE_ISOLATION="0")
    for name, run in report.items():  # with what namespaces this machine gives nobody, then with none at all
        assert run["error"] is None and "failure" not in run["extras"], (name, run)
        worker = run["worker"]
        assert run["extras"]["ppid"] == worker and run["extras"]["worker_has"] == ["pool"]
        assert run["extras"]["refused"][f"/proc/{worker}/environ"] == "PermissionError", name
        assert "missing: uid (" in run["summary"]
        assert run["summary"].endswith("code runs anyway (reward.require_isolation=false)")
    assert POOL_SECRET not in output  # it was only ever in the workers' environment
    if "network" in report["default"]["in_effect"]:  # in a user namespace: no process outside it is readable
        assert report["default"]["extras"]["leaks"] == [] and report["default"]["score"] == 1.0
    assert "missing: uid (this process cannot switch to another uid" in report["default"]["summary"]
    assert report["forced_none"]["in_effect"] == []
