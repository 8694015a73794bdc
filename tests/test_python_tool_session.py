"""The python tool's persistent interpreter: one sandboxed interpreter per trajectory, kept between calls (only the
new cell runs), stopped and rebuilt by replay after a failure, released when the trajectory ends, and one
trajectory's interpreter never sees another's variables, files or processes. Real sandboxed processes."""

import asyncio
import gc
import os
import time
from dataclasses import replace

import pytest

from rl360.agents.tools import ToolSettings, TrajectoryState, get_tool
from rl360.rewards.sandbox import SESSION_SLOTS, SESSION_UID_BASE, isolation, session_uid

# room for a loaded machine's interpreter start-up, which the first call of a trajectory includes
SETTINGS = ToolSettings(timeout_s=6, memory_mb=512, max_output_chars=2000)
COUNT = "open('runs', 'a').write('x')\nx = (x if 'x' in globals() else 0) + 1"


def run(coro):
    return asyncio.run(coro)


def call(tool, code, state):
    reply = run(tool.call({"code": code}, state))
    assert not reply.failed, (code, reply)
    return reply.text


def gone(pid, wait_s=10.0):
    """Whether process `pid` is gone (not even a zombie) within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while os.path.exists(f"/proc/{pid}"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def tool(request):
    """The tool; with `indirect` parametrization, the size of its warm pool (full before the test starts)."""
    pool = getattr(request, "param", 0)
    tool = get_tool("python", replace(SETTINGS, pool=pool))
    if pool:
        assert tool.warm(60) == pool
    yield tool
    tool.close()


def test_state_persists_and_only_the_new_cell_runs(tool):
    state = TrajectoryState(kwargs={"python": {"variables": {"a": 5}}})
    assert call(tool, COUNT + "\nprint(x, a)", state) == "1 5\n"
    pid = tool.interpreter_pid(state)
    assert call(tool, "import json\nprint(x, open('runs').read())", state) == "1 x\n"
    assert call(tool, "print(json.dumps([x]), open('runs').read())", state) == "[1] x\n"  # imports kept
    assert tool.interpreter_pid(state) == pid  # one interpreter served every call
    assert state.store["python"]["cells"][0].startswith("open('runs'")  # the cells stay, for a rebuild


def test_a_hanging_cell_is_stopped_and_the_next_call_rebuilds_the_state_by_replay(tool):
    state = TrajectoryState()
    call(tool, COUNT, state)
    pid = tool.interpreter_pid(state)
    started = time.monotonic()
    hung = run(tool.call({"code": "import time\nprint('going')\nwhile True:\n    time.sleep(0.01)"}, state))
    assert hung.timed_out and "time limit of 6 s" in hung.error
    assert time.monotonic() - started < SETTINGS.timeout_s + 5
    assert tool.interpreter_pid(state) is None and gone(pid)  # stopped, with every process of its uid
    # a new interpreter, its state rebuilt by running the earlier successful cell once more (in its own new
    # directory: the old one went with the old interpreter), then the new cell
    assert call(tool, "print(x, open('runs').read())", state) == "1 x\n"
    assert tool.interpreter_pid(state) not in (None, pid)
    crashed = run(tool.call({"code": "import os\nos.abort()"}, state))
    assert "stopped" in crashed.error and "SIGABRT" in crashed.error
    assert call(tool, "x += 1\nprint(x)", state) == "2\n"


def test_a_continued_trajectory_rebuilds_its_interpreter_once(tool):
    state = TrajectoryState(seed=3)
    call(tool, COUNT, state)
    call(tool, "import random\nr = random.random()", state)
    # the trajectory goes on elsewhere (resume, another process): a new tool, the state's store carried over
    other = get_tool("python", SETTINGS)
    try:
        moved = TrajectoryState(seed=3, store={"python": {key: list(value) for key, value in
                                                         state.store["python"].items()}})
        assert call(other, "print(x, open('runs').read(), r == __import__('random').Random(3).random())",
                    moved) == "1 x True\n"
        assert call(other, "print(open('runs').read())", moved) == "x\n"  # replayed once, not again
    finally:
        other.close()


@pytest.mark.skipif("uid" not in isolation().in_effect, reason="needs a uid of its own per sandbox (root)")
@pytest.mark.parametrize("tool", [0, 2], indirect=True, ids=["started-at-first-call", "warm-pool"])
def test_two_trajectories_running_side_by_side_cannot_see_each_other(tool):
    one, two = TrajectoryState(), TrajectoryState()
    setup = ("import os, subprocess\nsecret = 'alpha'\nopen('secret.txt', 'w').write(secret)\n"
             "child = subprocess.Popen(['sleep', '60'])\nprint(os.getuid(), child.pid, os.getcwd())")

    async def both(code_one, code_two):
        return await asyncio.gather(tool.call({"code": code_one}, one), tool.call({"code": code_two}, two))

    first, second = run(both(setup, "import os\nprint(os.getuid(), os.getcwd())"))
    assert not first.failed and not second.failed, (first, second)
    uid_one, child, cwd_one = first.text.split()
    uid_two, cwd_two = second.text.split()
    assert uid_one != uid_two and cwd_one != cwd_two and int(uid_one) >= SESSION_UID_BASE
    probe = ("import os\nseen = [int(p) for p in os.listdir('/proc') if p.isdigit()]\n"
             f"try:\n    os.kill({child}, 0)\n    signalled = 'yes'\nexcept OSError as error:\n"
             "    signalled = type(error).__name__\n"
             f"print('secret' in globals(), {child} in seen, signalled, os.path.exists({cwd_one!r} + '/secret.txt'))")
    looked, still = run(both("print(secret, open('secret.txt').read())", probe))
    assert looked.text == "alpha alpha\n"
    assert still.text == "False False PermissionError False\n", still
    assert os.path.exists(f"/proc/{child}")  # the sleeping child of the first is alive, and its alone
    pid = tool.interpreter_pid(one)
    tool.release(one)
    assert gone(pid) and gone(int(child))  # released: the interpreter and every process of its uid


@pytest.mark.parametrize("tool", [2], indirect=True)
def test_a_pooled_interpreter_serves_one_trajectory_only_and_the_pool_refills(tool):
    pooled = tool.pooled_pids()
    one = TrajectoryState(kwargs={"python": {"variables": {"a": 1}}})
    setup = ("import subprocess\nsecret = 'alpha'\nopen('secret.txt', 'w').write(secret)\n"
             "child = subprocess.Popen(['sleep', '60'])\nprint(a, child.pid)")
    a, child = call(tool, setup, one).split()
    first = tool.interpreter_pid(one)
    assert a == "1" and first in pooled and first not in tool.pooled_pids()  # taken out of the pool for good
    if os.geteuid() == 0 and "uid" in isolation().in_effect:  # a warm one waits at a lower priority, not a taken one
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert {os.getpriority(os.PRIO_PROCESS, pid) for pid in tool.pooled_pids()} == {min(own + 10, 19)}
        assert os.getpriority(os.PRIO_PROCESS, first) == own == os.getpriority(os.PRIO_PROCESS, int(child))
    tool.release(one)
    assert gone(first) and gone(int(child))
    assert tool.warm(60) == 2 and first not in tool.pooled_pids()  # refilled with new interpreters
    two = TrajectoryState(seed=3)
    probe = ("import os, random\nprint('secret' in globals(), 'a' in globals(), os.path.exists('secret.txt'), "
             "random.random() == __import__('random').Random(3).random())")
    assert call(tool, probe, two) == "False False False True\n"
    assert tool.interpreter_pid(two) not in (None, first)
    tool.release(two)


def test_the_interpreter_is_gone_when_the_trajectory_is_released_or_forgotten(tool):
    state = TrajectoryState()
    call(tool, "import subprocess\nchild = subprocess.Popen(['sleep', '60'])\nprint(child.pid)", state)
    pid = tool.interpreter_pid(state)
    tool.release(state)
    assert tool.interpreter_pid(state) is None and gone(pid)
    # a trajectory state dropped without a release: its interpreter goes when the state is collected
    lost = TrajectoryState()
    child = int(call(tool, "import subprocess\nchild = subprocess.Popen(['sleep', '60'])\nprint(child.pid)", lost))
    pid = tool.interpreter_pid(lost)
    del lost
    gc.collect()
    assert gone(pid) and gone(child)


def test_the_sandbox_isolation_holds_in_the_persistent_interpreter(tool):
    state = TrajectoryState()
    code = ("import os, socket\n"
            "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)\n    net = 'open'\n"
            "except OSError:\n    net = 'closed'\n"
            "others = [p for p in os.listdir('/proc') if p.isdigit() and p != str(os.getpid())]\n"
            "try:\n    open('/etc/shadow').read()\n    shadow = 'read'\nexcept OSError:\n    shadow = 'refused'\n"
            "print(net, shadow, os.environ.get('HOME') == os.getcwd(), sorted(os.environ))\n")
    text = call(tool, code, state)
    features = isolation().in_effect
    net, shadow, home, names = text.split(" ", 3)
    assert home == "True" and "PATH" in names and "RL360" not in names  # scrubbed environment, own directory
    if "network" in features:
        assert net == "closed"
    if "uid" in features:
        assert shadow == "refused"
    if "processes" in features:
        assert call(tool, "import os\nprint([p for p in os.listdir('/proc') if p.isdigit()] == [str(os.getpid())])",
                    state) == "True\n"
    big = run(tool.call({"code": "b = bytearray(900 << 20)"}, state))  # the address-space limit, per call
    assert "MemoryError" in big.error and call(tool, "print('alive')", state) == "alive\n"


def test_memory_held_across_processes_is_capped_per_call(tool):
    state = TrajectoryState()
    call(tool, "x = 7", state)
    spread = ("import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        block = bytearray(200 << 20)\n"
              "        time.sleep(60)\n        os._exit(0)\ntime.sleep(60)")
    over = run(tool.call({"code": spread}, state))
    # stopped by the memory watch, not by the call's time limit (which a loaded machine can come close to)
    assert "memory limit of 512 MB" in over.error and not over.timed_out, over
    assert call(tool, "print(x)", state) == "7\n"  # a new interpreter, the state rebuilt


def test_session_uids_are_distinct_per_slot_and_process():
    if session_uid(0) is None:
        pytest.skip("this process cannot change uid")
    uids = {session_uid(slot) for slot in range(SESSION_SLOTS)}
    assert len(uids) == SESSION_SLOTS and min(uids) >= SESSION_UID_BASE and max(uids) < 2**32 - 1
    with pytest.raises(ValueError):
        session_uid(SESSION_SLOTS)


def test_replay_mode_runs_every_call_in_a_new_interpreter_that_rebuilds_the_state():
    tool = get_tool("python", replace(SETTINGS, replay=True, pool=2))
    state = TrajectoryState(kwargs={"python": {"variables": {"a": 5}}})
    try:
        assert call(tool, COUNT + "\nprint(x, a)", state) == "1 5\n"
        assert tool.interpreter_pid(state) is None  # stopped after its call
        assert call(tool, COUNT + "\nprint(x, a, open('runs').read())", state) == "2 5 xx\n"
        assert tool.interpreter_pid(state) is None and tool.pooled_pids() == []  # no warm pool in this mode
    finally:
        tool.close()


def test_a_worker_sent_sigterm_stops_its_interpreters_and_exits(tool):
    """What multiprocessing does to its daemon children at exit: the worker must not outlive it."""
    import signal

    state = TrajectoryState()
    call(tool, "x = 1", state)
    pid = tool.interpreter_pid(state)
    [worker] = [worker for worker in tool._workers if worker.sessions]
    os.kill(worker.process.pid, signal.SIGTERM)
    worker.process.join(10)
    assert worker.process.exitcode == 0 and gone(pid)
