"""The code sandbox and the `codegen` reward: attacks score 0 and leave the host unharmed."""

import functools
import json
import os
import socket
import subprocess
import time
from pathlib import Path
from unittest import mock

import pytest

from rl360.rewards import RewardItem, RewardPool, RewardResult, codegen, register_reward
from rl360.rewards.codegen import codegen_score, extract_code, outputs_match
from rl360.rewards.sandbox import (
    FEATURES,
    ISOLATION_ENV,
    REQUIRE_ENV,
    Isolation,
    IsolationError,
    SandboxLimits,
    _uid_for,
    allowed_features,
    filesystem_isolation_available,
    isolation,
    isolation_env,
    isolation_required,
    network_isolation_available,
    process_isolation_available,
    refuse_untrusted_code,
    run_command,
    run_python,
    sandbox_uid,
)
from tests.test_sandbox_secrets import as_nobody_python

needs_uid = pytest.mark.skipif(sandbox_uid() is None, reason="this process cannot run code under another uid")
needs_netns = pytest.mark.skipif(not network_isolation_available(), reason="the kernel refuses network namespaces")
needs_mountns = pytest.mark.skipif(not filesystem_isolation_available(),
                                   reason="the kernel refuses mount namespaces with private tmpfs mounts")
DOUBLE = json.dumps({"inputs": ["3\n", "10\n"], "outputs": ["6\n", "20\n"]})
REPO = Path(__file__).resolve().parents[1]
SMALL = "test_small_codegen__t"  # the codegen reward with small limits, in pool workers
SMALL_MEMORY = 1 << 30
# four processes touching 400 MiB each (bytearray zero-fills its pages): 1.6 GiB in all, each far below RLIMIT_AS
SPREAD = ("import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        block = bytearray(400 << 20)\n"
          "        time.sleep(60)\nos.wait()\n")


@register_reward("test_small_codegen")
def small_codegen(solution_str, ground_truth, extra_info=None):
    """The codegen reward with a 5 s case timeout (long enough for 1.6 GiB to be touched on a loaded machine)
    and SMALL_MEMORY in all (pool workers import it)."""
    limits = functools.partial(SandboxLimits, memory_bytes=SMALL_MEMORY)
    with mock.patch.object(codegen, "CASE_TIMEOUT_S", 5.0), mock.patch.object(codegen, "SandboxLimits", limits):
        return codegen_score(solution_str, ground_truth, extra_info)


def _response(code: str) -> str:
    return f"<think>```python\nprint('draft')\n```</think>Solution:\n```python\n{code}\n```\n"


def _doubling(prefix: str = "") -> str:
    """A correct answer to DOUBLE, preceded by `prefix` (the attack)."""
    return _response(prefix + "\nprint(int(input()) * 2)")


def _score(code_response: str, truth: str = DOUBLE) -> dict:
    return codegen_score(code_response, truth)


class Host:
    """A reward pool with one worker, and host files that an attack must leave alone: sentinels that anyone
    may write (in tmp_path, /tmp and /dev/shm) and paths it may try to create (in /tmp, /var/tmp, /dev/shm,
    the repository, the home directory and tmp_path)."""

    def __init__(self, pool: RewardPool, tmp_path: Path):
        self.pool = pool
        tag = f"rl360-test-{os.getpid()}-{time.monotonic_ns()}"
        self.sentinels = [tmp_path / "sentinel", Path("/tmp", tag), Path("/dev/shm", tag)]
        self.strays = [Path(place, f"{tag}-stray") for place in ("/tmp", "/var/tmp", "/dev/shm", REPO, Path.home(),
                                                                   tmp_path)]
        for path in self.sentinels:
            path.write_text("original")
            path.chmod(0o666)

    def score(self, attack: str, data_source: str = "codegen__t") -> RewardResult:
        """Score `attack` followed by a correct answer and check that it is contained: it scores 0; the worker
        that ran it is the same live process and no process of its sandbox uid is left; the sentinels are
        unchanged and no stray file exists; the host still starts processes; the pool then scores a correct
        solution 1.0. Returns the attack's result."""
        worker = self.pool._workers[0].process
        [result] = self.pool.score([RewardItem(data_source, _doubling(attack), DOUBLE)])
        assert result.score == 0.0 and result.error is None and not result.timed_out, result
        assert self.pool._workers[0].process is worker and worker.is_alive()
        if (uid := _uid_for(worker.pid)) is not None:
            assert _sandbox_processes(uid) == []
        assert [path.read_text() for path in self.sentinels] == ["original"] * len(self.sentinels)
        assert [path for path in self.strays if path.exists()] == []
        assert subprocess.run(["true"]).returncode == 0
        assert self.pool.score([RewardItem(data_source, _doubling(), DOUBLE)])[0].score == 1.0
        return result

    def remove_files(self) -> None:
        for path in self.sentinels + self.strays:
            path.unlink(missing_ok=True)


@pytest.fixture
def host(tmp_path):
    with RewardPool(num_workers=1, timeout_s=60) as pool:
        host = Host(pool, tmp_path)
        try:
            yield host
        finally:
            host.remove_files()


def _sandbox_processes(uid: int | None = None, settle_s: float = 5.0) -> list[int]:
    """Pids of live (non-zombie) processes running under `uid` (this process's sandbox uid by default), after
    up to `settle_s` for killed ones to finish exiting."""
    uid = sandbox_uid() if uid is None else uid
    deadline = time.monotonic() + settle_s
    while (found := _processes_now(uid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def _processes_now(uid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as handle:
                fields = dict(line.split(":", 1) for line in handle if ":" in line)
        except OSError:
            continue
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
            found.append(int(name))
    return found


# --- correct and wrong solutions ----------------------------------------------------------------------


def test_extract_code_takes_the_last_block_after_think():
    assert extract_code(_response("x = 1")) == "x = 1\n"
    assert extract_code("```\na\n```\ntext\n```py\nb\n```") == "b\n"
    assert extract_code("<think>```python\nx\n```</think> no code") is None


def test_correct_stdin_stdout_solution_scores_one():
    result = _score(_doubling())
    assert result["score"] == 1.0 and result["pass_fraction"] == 1.0 and result["passed"] == 2


def test_wrong_solution_scores_zero_and_stops_at_the_first_failure():
    truth = json.dumps({"inputs": ["1\n", "2\n", "3\n"], "outputs": ["1\n", "3\n", "3\n"]})
    result = _score(_response("print(input())"), truth)
    assert result["score"] == 0.0 and result["passed"] == 1 and result["failure"] == "case 1: wrong answer"
    assert result["pass_fraction"] == pytest.approx(1 / 3)


def test_functional_truth():
    truth = json.dumps({"functional": "def check(f):\n    assert f(2) == 3\ncheck(inc)"})
    assert _score(_response("def inc(x):\n    return x + 1"), truth)["score"] == 1.0
    wrong = _score(_response("def inc(x):\n    return x"), truth)
    assert wrong["score"] == 0.0 and "AssertionError" in wrong["failure"]


def test_runtime_error_and_missing_code_score_zero():
    assert "runtime error" in _score(_response("raise SystemExit(3)"))["failure"]
    assert _score("no code at all")["failure"] == "no fenced code block in the response"


@pytest.mark.parametrize("actual,expected,match", [
    ("6  \n\n", "6", True),
    ("1 2\n3\n", "1 2  \n3", True),
    ("0.3333333333", "0.333333", True),
    ("1000000.0000001", "1000000", True),
    ("0.3334", "0.3333", False),
    ("1 2", "1  2 3", False),
    ("abc", "abd", False),
    ("1\n2", "1 2", False),
    ("nan", "nan", True),
])
def test_outputs_match_tolerantly(actual, expected, match):
    assert outputs_match(actual, expected) is match


def test_scrubbed_environment_and_own_directory(monkeypatch):
    monkeypatch.setenv("RL360_SECRET_TOKEN", "hunter2")
    result = run_python("import os, json; print(json.dumps([dict(os.environ), os.getcwd(), os.listdir('.')]))")
    env, cwd, listing = json.loads(result.stdout)
    assert "RL360_SECRET_TOKEN" not in env and env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["HOME"] == cwd and listing == ["solution.py"]
    assert not os.path.exists(cwd)  # deleted afterwards


def test_output_is_capped():
    result = run_python("while True: print('x' * 1000)", limits=SandboxLimits(max_output_bytes=10_000))
    assert result.output_truncated and len(result.stdout) == 10_000 and not result.ok


# --- attacks ------------------------------------------------------------------------------------------


@needs_uid
@needs_mountns
def test_writing_outside_its_directory_fails_or_vanishes(host):
    targets = [str(path) for path in host.strays + host.sentinels]
    attack = (f"refused = []\nfor index, path in enumerate({targets!r}):\n    try:\n"
              "        open(path, 'a').write('tampered')\n    except OSError:\n        refused.append(index)\n"
              "raise SystemExit(f'refused {refused}')\n")
    # refused: the repository, home and tmp_path strays and the tmp_path sentinel; the writes to /tmp, /var/tmp
    # and /dev/shm succeed, in private directories that are gone once the run ends
    assert "refused [3, 4, 5, 6]" in host.score(attack).extras["failure"]
    # the repository: not its uid's to write, or, for a checkout under /tmp, absent from the private /tmp
    failure = host.score(f"open({str(host.strays[3])!r}, 'w').write('x')").extras["failure"]
    assert "PermissionError" in failure or "FileNotFoundError" in failure
    # the other order: tampering with an existing file first
    host.score(f"open({str(host.sentinels[0])!r}, 'w').write('gone')")


@needs_mountns
def test_private_directories_are_empty_bounded_and_unseen_by_the_host():
    big = f"/dev/shm/rl360-test-{os.getpid()}-big"
    code = ("import os\nprint(sorted(set(os.listdir('/tmp')) - {os.path.basename(os.getcwd())}),"
            f" os.listdir('/dev/shm'))\nopen({big!r}, 'wb').write(b'x' * (2 << 20))")
    result = run_python(code, limits=SandboxLimits(tmpfs_bytes=1 << 20))
    leaked = os.path.exists(big)
    Path(big).unlink(missing_ok=True)
    assert not leaked and result.filesystem_isolated and result.stdout == "[] []\n"
    assert "No space left on device" in result.stderr and not result.ok


@needs_netns
def test_network_connection_fails_and_never_arrives(host):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        attack = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')\n"
        assert "unreachable" in host.score(attack).extras["failure"]
        with pytest.raises(TimeoutError):
            server.accept()


@needs_uid
def test_fork_bomb_is_bounded_and_the_host_still_spawns(host):
    attack = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    started = time.monotonic()
    assert host.score(attack, SMALL).extras["failure"] == "case 0: timeout"
    assert time.monotonic() - started < 20


@needs_uid
def test_a_process_that_leaves_the_group_is_killed_too():
    attack = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
              "        time.sleep(600)\n    os._exit(0)\n")
    assert _score(_doubling(attack))["score"] == 1.0  # the answer is right; the daemon must still go
    assert _sandbox_processes() == []


def test_allocating_8gb_fails_and_the_host_is_fine(host):
    assert "MemoryError" in host.score("block = bytearray(8 << 30)").extras["failure"]
    assert len(bytearray(1 << 20)) == 1 << 20


def test_allocating_memory_across_processes_is_killed(host):
    failure = host.score(SPREAD, SMALL).extras["failure"]
    assert "memory over the limit (all its processes together)" in failure
    assert len(bytearray(1 << 20)) == 1 << 20


def test_total_memory_bound_and_what_stays_within_it():
    limits = SandboxLimits(memory_bytes=SMALL_MEMORY, timeout_s=10.0)
    over = run_python(SPREAD, limits=limits)
    assert over.memory_exceeded and not over.timed_out and not over.ok and over.wall_s < 8
    assert _sandbox_processes() == []
    within = run_python(SPREAD.replace("range(4)", "range(2)").replace("time.sleep(60)", "os._exit(0)")
                        + "os.wait()\nprint('ok')", limits=limits)
    assert within.ok and within.stdout == "ok\n" and not within.memory_exceeded


def test_without_a_uid_of_its_own_memory_is_summed_over_its_session(monkeypatch):
    from rl360.rewards import sandbox

    monkeypatch.setattr(sandbox, "sandbox_uid", lambda: None)
    monkeypatch.setenv(REQUIRE_ENV, "0")  # missing isolation is refused unless not required
    result = run_python(SPREAD, limits=SandboxLimits(memory_bytes=SMALL_MEMORY, timeout_s=10.0))
    assert result.memory_exceeded and not result.timed_out and not result.uid_isolated


def test_sleeping_forever_times_out(host):
    started = time.monotonic()
    assert host.score("import time\ntime.sleep(10**6)", SMALL).extras["failure"] == "case 0: timeout"
    assert time.monotonic() - started < 10


@needs_uid
def test_killing_its_parent_fails_and_the_pool_survives(host):
    attack = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)"
    assert "PermissionError" in host.score(attack).extras["failure"]  # the parent is the pool's worker
    # in this process too: the test process is the parent here
    assert _score(_doubling(attack))["score"] == 0.0


def test_closing_its_output_and_hanging_still_times_out():
    result = run_python("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)",
                        limits=SandboxLimits(timeout_s=1.0))
    assert result.timed_out and not result.ok


def test_code_that_ends_after_closing_its_output_is_not_cut_short():
    result = run_python("import os, sys, time\nprint('done', flush=True)\nos.close(1)\ntime.sleep(0.5)\n"
                        "sys.exit(0)", limits=SandboxLimits(timeout_s=5.0))
    assert result.ok and result.stdout == "done\n"


def test_without_network_namespaces_code_still_runs_and_says_so(monkeypatch):
    from rl360.rewards import sandbox

    monkeypatch.setattr(sandbox, "network_isolation_available", lambda: False)
    monkeypatch.setenv(REQUIRE_ENV, "0")  # missing isolation is refused unless not required
    result = run_python("print('hi')")
    assert result.ok and result.stdout == "hi\n" and result.network_isolated is False


def test_without_mount_namespaces_code_still_runs_and_says_so(monkeypatch):
    from rl360.rewards import sandbox

    monkeypatch.setattr(sandbox, "filesystem_isolation_available", lambda: False)
    monkeypatch.setenv(REQUIRE_ENV, "0")  # missing isolation is refused unless not required
    result = run_python("import os\nprint(os.listdir('.'))")
    assert result.ok and result.stdout == "['solution.py']\n" and result.filesystem_isolated is False


# --- isolation: what is in effect, said in one line, and refused where it is missing --------------------

needs_processes = pytest.mark.skipif(sandbox_uid() is None or not process_isolation_available(),
                                     reason="no uid switch or no private /proc here")
REFUSES = RewardItem("codegen__t", _doubling(), DOUBLE)


def test_isolation_settings_are_read_strictly():
    assert allowed_features({}) == frozenset(FEATURES) == allowed_features({ISOLATION_ENV: " Auto "})
    assert allowed_features({ISOLATION_ENV: "none"}) == frozenset()
    assert allowed_features({ISOLATION_ENV: "uid, network"}) == {"uid", "network"}
    with pytest.raises(ValueError, match=r"RL360_SANDBOX_ISOLATION='uid,net': unknown isolation \['net'\]"):
        allowed_features({ISOLATION_ENV: "uid,net"})
    assert isolation_required({}) and isolation_required({REQUIRE_ENV: "yes"})
    assert not isolation_required({REQUIRE_ENV: "0"}) and not isolation_required({REQUIRE_ENV: "False"})
    with pytest.raises(ValueError, match="RL360_SANDBOX_REQUIRE_ISOLATION='maybe'"):
        isolation_required({REQUIRE_ENV: "maybe"})
    assert isolation_env(False) == {REQUIRE_ENV: "0"} and isolation_env(True) == {REQUIRE_ENV: "1"}


@needs_uid
@needs_processes
def test_full_isolation_is_announced_and_code_runs():
    found = isolation({})
    assert found.in_effect == FEATURES and found.missing == () and not found.refuses
    assert found.summary() == ("rl360 sandbox: untrusted code runs isolated: a uid of its own, no network, "
                               "private /tmp, /var/tmp, /dev/shm and work directory, other processes hidden "
                               "(private /proc)")
    result = run_python("print('ok')")
    assert result.ok and result.uid_isolated and result.network_isolated and result.filesystem_isolated
    assert result.processes_isolated


def test_without_isolation_untrusted_code_is_refused_and_the_line_says_what_is_missing(monkeypatch):
    monkeypatch.setenv(ISOLATION_ENV, "network,filesystem")  # as a machine without root would be
    found = isolation()
    assert "uid" not in found.in_effect and found.refuses and "\n" not in found.summary()
    assert found.summary().startswith("rl360 sandbox: WARNING: untrusted code is not fully isolated; in effect: ")
    assert "missing: uid (turned off by RL360_SANDBOX_ISOLATION='network,filesystem'); processes (" in found.summary()
    assert found.summary().endswith("; code is refused (reward.require_isolation=true)")
    with pytest.raises(IsolationError, match=r"refusing to run untrusted code without isolation \(missing: uid"):
        run_python("open('/tmp/never-written', 'w')")
    with pytest.raises(IsolationError):
        run_command(["/bin/true"])
    monkeypatch.setenv(REQUIRE_ENV, "0")  # the user accepts the risk: it runs, and says what it had
    assert isolation().summary().endswith("; code runs anyway (reward.require_isolation=false)")
    result = run_python("import os\nprint(os.getuid())")
    assert result.ok and result.stdout == f"{os.getuid()}\n" and not result.uid_isolated
    assert not result.processes_isolated


def test_a_codegen_row_without_isolation_scores_zero_as_a_counted_error(monkeypatch):
    with RewardPool(num_workers=1, timeout_s=60, env={ISOLATION_ENV: "none"}) as pool:
        found = pool.sandbox_isolation()  # probed in the worker, with the worker's environment
        assert found.refuses and found.in_effect == () and [f for f, _ in found.missing] == list(FEATURES)
        [result] = pool.score([REFUSES])
        assert result.score == 0.0 and result.error.startswith("IsolationError: refusing to run untrusted code")
        assert pool.last_metrics()["reward/errors/codegen"] == 1


@needs_uid
@needs_mountns
def test_isolation_is_probed_once_per_process_with_one_run(monkeypatch):
    from rl360.rewards import sandbox

    runs = []
    real_run = sandbox._run

    def counting(*args, **kwargs):
        runs.append(args[0])
        return real_run(*args, **kwargs)

    monkeypatch.setattr(sandbox, "_run", counting)
    sandbox._unsupported.cache_clear()
    sandbox._probe.cache_clear()
    first = isolation()
    assert runs == [["/bin/true"]]  # everything available: one probe with all of it
    assert isolation() == first and runs == [["/bin/true"]]  # then cached


@needs_uid
@needs_processes
def test_other_processes_are_invisible_and_stdin_still_opens_by_path():
    code = ("import os\npids = sorted(int(n) for n in os.listdir('/proc') if n.isdigit())\n"
            "print(pids == [os.getpid()], os.path.exists(f'/proc/{os.getppid()}'), os.path.exists('/proc/1'))\n"
            "print(open('/dev/stdin').read())")
    result = run_python(code, stdin="from stdin")
    assert result.ok and result.stdout == "True False False\nfrom stdin\n", result.stderr


def test_as_a_user_that_cannot_switch_uid_the_run_warns_and_refuses(tmp_path):
    """A real non-root process (setpriv to nobody): the probe finds no uid switch, the start-up line says so,
    code is refused; allowed knowingly, it runs as that user."""
    script = ("import json, os\nfrom rl360.rewards.sandbox import IsolationError, isolation, run_python\n"
              "report = {'summary': isolation().summary()}\n"
              "try:\n    run_python('print(1)')\nexcept IsolationError as err:\n    report['refused'] = str(err)\n"
              "os.environ['RL360_SANDBOX_REQUIRE_ISOLATION'] = '0'\n"
              "result = run_python('import os; print(os.getuid())')\n"
              "report.update(stdout=result.stdout, uid_isolated=result.uid_isolated, error=result.error)\n"
              "print(json.dumps(report))\n")
    command, path = as_nobody_python()
    tmp_path.chmod(0o777)
    done = subprocess.run([*command, "-c", script], env={"PATH": os.environ["PATH"], "HOME": str(tmp_path),
                          "PYTHONPATH": path}, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["summary"].startswith("rl360 sandbox: WARNING: untrusted code is not fully isolated")
    assert "missing: uid (this process cannot switch to another uid (it is not root)" in report["summary"]
    assert "refusing to run untrusted code without isolation (missing: uid" in report["refused"]
    assert report["stdout"] == "65534\n" and report["uid_isolated"] is False and report["error"] is None


def test_only_rewards_that_run_code_make_a_run_refuse_at_start():
    from rl360.rewards.registry import find_route

    missing = Isolation(("network",), (("uid", "why"),), required=True)
    refs = {source: find_route(source) for source in ("codegen__x", "simulation__cruxeval_i", "taco", "math__z",
                                                       "logic__zebra_puzzle", "simulation__codeio")}
    with pytest.raises(IsolationError, match=r"the data holds \['codegen__x', 'simulation__cruxeval_i', 'taco'\], "
                                             r"scored by running the response's code: refusing to run untrusted code"):
        refuse_untrusted_code(refs, missing)
    refuse_untrusted_code(refs, Isolation(("network",), (("uid", "why"),), required=False))  # not required
    refuse_untrusted_code(refs, Isolation(FEATURES, (), required=True))  # complete
    refuse_untrusted_code(refs, Isolation((), (), required=True, remote_url="http://sandbox:8080"))  # remote
