"""The python tool's interpreters forked from a sandbox zygote (`rl360.rewards.zygote`): a forked interpreter
holds the session's uid and nothing of the zygote (no capability, no descriptor, none of its environment), two
running at once see nothing of each other, a zygote that dies is replaced, a failed set-up leaves nothing
behind, and without the fork path (no uid of its own; the replay mode) interpreters start by exec. Real
sandboxed processes."""

import asyncio
import json
import os
import signal
import time
from dataclasses import replace

import pytest

from rl360.agents.tools import ToolSettings, TrajectoryState, get_tool
from rl360.rewards import sandbox
from rl360.rewards.sandbox import ISOLATION_ENV, REQUIRE_ENV, SESSION_UID_BASE, SandboxLimits, isolation

SETTINGS = ToolSettings(timeout_s=20, memory_mb=512, max_output_chars=4000)
needs_uid = pytest.mark.skipif("uid" not in isolation().in_effect, reason="the fork path needs a uid of its own (root)")


def call(tool, code, state):
    reply = asyncio.run(tool.call({"code": code}, state))
    assert not reply.failed, (code, reply)
    return reply.text


def parent(pid):
    with open(f"/proc/{pid}/status") as handle:
        return int(next(line.split()[1] for line in handle if line.startswith("PPid:")))


def cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        return handle.read().replace(b"\0", b" ").decode()


def dead(pid, wait_s=10.0):
    """Whether `pid` is gone or a zombie within `wait_s` (an orphan's reaper here may be slow or absent)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                if handle.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def tool():
    tool = get_tool("python", SETTINGS)
    yield tool
    tool.close()


@needs_uid
def test_a_forked_interpreter_holds_its_uid_and_nothing_of_the_zygote(tool):
    state = TrajectoryState()
    code = ("import json, os\nstatus = dict(line.split(':', 1) for line in open('/proc/self/status'))\n"
            "fds = [os.readlink('/proc/self/fd/' + fd) for fd in os.listdir('/proc/self/fd')\n"
            "       if os.path.exists('/proc/self/fd/' + fd)]  # not the listing's own\n"
            "print(json.dumps({'uid': os.getresuid(), 'gid': os.getresgid(), 'groups': os.getgroups(),\n"
            "    'caps': [int(status[k], 16) for k in ('CapInh', 'CapPrm', 'CapEff', 'CapAmb')],\n"
            "    'no_new_privs': int(status['NoNewPrivs']), 'sockets': [fd for fd in fds if 'socket' in fd],\n"
            "    'env': sorted(os.environ), 'home': os.environ['HOME'] == os.getcwd()}))")
    seen = json.loads(call(tool, code, state))
    pid = tool.interpreter_pid(state)
    assert "zygote_main.py" in cmdline(parent(pid))  # forked by the zygote, not started by an exec
    uid = seen["uid"][0]
    assert uid >= SESSION_UID_BASE and seen["uid"] == [uid] * 3 and seen["gid"] == [uid] * 3, seen
    assert seen["groups"] == [] and seen["caps"] == [0, 0, 0, 0] and seen["no_new_privs"] == 1, seen
    assert seen["sockets"] == [] and seen["home"], seen  # the zygote's socket closed; its own directory
    assert seen["env"] == sorted({*sandbox.sandbox_env("/"), "MPLBACKEND"})  # the driver sets MPLBACKEND


@needs_uid
def test_two_forked_interpreters_running_at_once_share_no_tmp_variable_or_process(tool):
    one, two = TrajectoryState(), TrajectoryState()
    setup = ("import os, subprocess, time\nsecret = 'alpha'\nfor d in ('/tmp', '/dev/shm', '.'):\n"
             "    open(d + '/secret-one', 'w').write(secret)\nchild = subprocess.Popen(['sleep', '60'])\n"
             "print(child.pid)")
    probe = ("import os, time\ntime.sleep(0.5)\nseen = [int(p) for p in os.listdir('/proc') if p.isdigit()]\n"
             "print('secret' in globals(), [os.path.exists(d + '/secret-one') for d in ('/tmp', '/dev/shm', '.')],"
             " len(seen))")

    async def both():
        return await asyncio.gather(tool.call({"code": setup}, one), tool.call({"code": probe}, two))

    first, second = asyncio.run(both())
    assert not first.failed and not second.failed, (first, second)
    assert "zygote_main.py" in cmdline(parent(tool.interpreter_pid(two)))
    assert second.text == "False [False, False, False] 1\n"  # sees only itself in /proc
    assert call(tool, "print(open('/tmp/secret-one').read(), secret)", one) == "alpha alpha\n"
    assert call(tool, "print(os.path.exists('/tmp/secret-one'))", two) == "False\n"
    child = int(first.text)
    tool.release(one)
    assert dead(child)


@needs_uid
def test_a_dead_zygote_is_replaced_and_its_children_are_still_stopped():
    tool = get_tool("python", replace(SETTINGS, workers=1, timeout_s=6))  # one worker: one zygote to replace
    try:
        _dead_zygote(tool)
    finally:
        tool.close()


def _dead_zygote(tool):
    one = TrajectoryState()
    call(tool, "x = 1", one)
    first = tool.interpreter_pid(one)
    zygote = parent(first)
    os.kill(zygote, signal.SIGKILL)
    assert dead(zygote)
    assert call(tool, "print(x)", one) == "1\n"  # its interpreter lives on (its pipes are its own)
    two = TrajectoryState()
    assert call(tool, "y = 2\nprint(y)", two) == "2\n"
    second = tool.interpreter_pid(two)
    assert parent(second) != zygote and "zygote_main.py" in cmdline(parent(second))  # a new zygote
    tool.release(one)
    assert dead(first)  # stopped from the worker, the zygote being gone
    hung = asyncio.run(tool.call({"code": "while True: pass"}, two))
    assert hung.timed_out and dead(second)
    assert call(tool, "print(y)", two) == "2\n"  # a fresh interpreter from the new zygote, the cell replayed once


@pytest.mark.parametrize("how", ["no-uid", "replay"])
def test_without_the_fork_path_interpreters_start_by_exec(how, monkeypatch):
    if how == "no-uid":  # what a machine without the uid switch gets; the exec path's isolation
        monkeypatch.setenv(ISOLATION_ENV, "network,filesystem")
        monkeypatch.setenv(REQUIRE_ENV, "0")
    tool = get_tool("python", replace(SETTINGS, replay=how == "replay"))
    try:
        state = TrajectoryState()
        text = call(tool, "import os, sys\nprint(os.getppid(), os.getuid(), sys.argv[0])", state)
        ppid, uid, argv0 = text.split()
        assert int(ppid) in [worker.process.pid for worker in tool._workers] and argv0 == "driver.py"
        if "uid" in isolation().in_effect:
            assert (int(uid) == os.getuid()) == (how == "no-uid")
    finally:
        tool.close()


@needs_uid
def test_a_set_up_the_kernel_refuses_runs_nothing_and_leaves_no_process_and_no_directory(monkeypatch):
    from rl360.rewards.zygote import Zygote
    from rl360.rewards.zygote_main import SETUP_FAILED

    zygote = Zygote(sandbox.sandbox_python())
    made = []
    make_workdir = sandbox.make_workdir
    monkeypatch.setattr(sandbox, "make_workdir", lambda *args: made.append(make_workdir(*args)) or made[-1])
    try:
        # a private directory one byte large: the driver file cannot be written into it, so the set-up fails
        child = zygote.start("print('ran')", {"driver.py": "x" * 65536}, SandboxLimits(tmpfs_bytes=1), 7)
        output = child.process.stdout.read().decode()
        assert output.startswith(SETUP_FAILED) and "ran" not in output and output.count("\n") == 1, output
        child.stop()
        assert child.process.returncode == 127 and len(made) == 1 and not os.path.exists(made[0])
        uid = sandbox.session_uid(7)
        assert not [p for p in os.listdir("/proc") if p.isdigit() and os.stat(f"/proc/{p}").st_uid == uid]
        child = zygote.start("import sys\nprint('ran', sys.argv[0])", {}, SandboxLimits(), 7)  # the zygote lives on
        assert child.process.stdout.read() == b"ran driver.py\n"
        child.stop()
        assert child.process.returncode == 0
    finally:
        zygote.close()
    assert zygote.process.returncode == 0
