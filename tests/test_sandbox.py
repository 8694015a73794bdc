"""The code sandbox and the `codegen` reward: attacks score 0 and leave the host unharmed."""

import json
import os
import socket
import subprocess
import time

import pytest

from rl360.rewards import RewardItem, RewardPool, codegen
from rl360.rewards.codegen import codegen_score, extract_code, outputs_match
from rl360.rewards.sandbox import (
    SandboxLimits,
    network_isolation_available,
    run_python,
    sandbox_uid,
)

needs_uid = pytest.mark.skipif(sandbox_uid() is None, reason="this process cannot run code under another uid")
needs_netns = pytest.mark.skipif(not network_isolation_available(), reason="the kernel refuses network namespaces")
DOUBLE = json.dumps({"inputs": ["3\n", "10\n"], "outputs": ["6\n", "20\n"]})


def _response(code: str) -> str:
    return f"<think>```python\nprint('draft')\n```</think>Solution:\n```python\n{code}\n```\n"


def _doubling(prefix: str = "") -> str:
    """A correct answer to DOUBLE, preceded by `prefix` (the attack)."""
    return _response(prefix + "\nprint(int(input()) * 2)")


def _score(code_response: str, truth: str = DOUBLE) -> dict:
    return codegen_score(code_response, truth)


@pytest.fixture
def fast_timeout(monkeypatch):
    monkeypatch.setattr(codegen, "CASE_TIMEOUT_S", 1.0)


def _sandbox_processes(settle_s: float = 5.0) -> list[int]:
    """Pids of live (non-zombie) processes running under this process's sandbox uid, after up to `settle_s` for
    killed ones to finish exiting."""
    deadline = time.monotonic() + settle_s
    while (found := _sandbox_processes_now()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def _sandbox_processes_now() -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as handle:
                fields = dict(line.split(":", 1) for line in handle if ":" in line)
        except OSError:
            continue
        uid = int(fields["Uid"].split()[0])
        if uid == sandbox_uid() and not fields["State"].strip().startswith("Z"):
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
def test_writing_outside_its_directory_fails(tmp_path):
    existing = tmp_path / "existing.txt"
    existing.write_text("original")
    target = tmp_path / "pwned.txt"
    attack = (f"open({str(target)!r}, 'w').write('x')\n"
              f"open({str(existing)!r}, 'a').write('tampered')\n")
    result = _score(_doubling(attack))
    assert result["score"] == 0.0 and "PermissionError" in result["failure"]
    assert not target.exists() and existing.read_text() == "original"
    # the other order: tampering with an existing file first
    assert _score(_doubling(f"open({str(existing)!r}, 'w').write('gone')"))["score"] == 0.0
    assert existing.read_text() == "original"


@needs_netns
def test_network_connection_fails_and_never_arrives():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        attack = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')\n"
        result = _score(_doubling(attack))
        assert result["score"] == 0.0 and "unreachable" in result["failure"]
        with pytest.raises(TimeoutError):
            server.accept()


@needs_uid
def test_fork_bomb_is_bounded_and_the_host_still_spawns(fast_timeout):
    attack = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    started = time.monotonic()
    result = _score(_doubling(attack))
    assert result["score"] == 0.0 and result["failure"] == "case 0: timeout"
    assert time.monotonic() - started < 20
    assert subprocess.run(["true"]).returncode == 0
    assert _sandbox_processes() == []


@needs_uid
def test_a_process_that_leaves_the_group_is_killed_too():
    attack = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
              "        time.sleep(600)\n    os._exit(0)\n")
    assert _score(_doubling(attack))["score"] == 1.0  # the answer is right; the daemon must still go
    assert _sandbox_processes() == []


def test_allocating_8gb_fails_and_the_host_is_fine():
    result = _score(_doubling("block = bytearray(8 << 30)"))
    assert result["score"] == 0.0 and "MemoryError" in result["failure"]
    assert len(bytearray(1 << 20)) == 1 << 20


def test_sleeping_forever_times_out(fast_timeout):
    started = time.monotonic()
    result = _score(_doubling("import time\ntime.sleep(10**6)"))
    assert result["score"] == 0.0 and result["failure"] == "case 0: timeout"
    assert time.monotonic() - started < 10


@needs_uid
def test_killing_its_parent_fails_and_the_pool_survives():
    attack = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)"
    good = RewardItem("codegen__t", _doubling(), DOUBLE)
    with RewardPool(num_workers=1, timeout_s=60) as pool:
        worker = pool._workers[0].process
        results = pool.score([RewardItem("codegen__t", _doubling(attack), DOUBLE), good])
        assert [r.score for r in results] == [0.0, 1.0]
        assert "PermissionError" in results[0].extras["failure"] and results[0].error is None
        assert pool._workers[0].process is worker and worker.is_alive()  # the worker was never killed
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
    result = run_python("print('hi')")
    assert result.ok and result.stdout == "hi\n" and result.network_isolated is False
