"""`python`, PyVision's tool: run the model's Python code over the conversation's images, in the sandbox.

**One live interpreter per trajectory.** A trajectory's first call starts a sandboxed Python interpreter
(`rl360.rewards.sandbox.start_session`: the isolation and limits of `run_command`, i.e. a uid of its own, no
network, private tmpfs mounts and /proc, CPU/address-space/file/process limits, scrubbed environment) running a
small driver; each call sends only its new cell, as one JSON line on the interpreter's stdin, and reads the
reply, a JSON line after a random per-interpreter marker, from its stdout. Variables, imports and files of
earlier calls are there, as in a notebook; `random` is seeded per trajectory when the interpreter starts. The
interpreter is released (killed with every process of its uid, its directory deleted) when the trajectory ends
or is aborted: the agent loop calls `release(state)` in a `finally`; a trajectory state dropped without one
releases it when garbage-collected, and `close()` releases all.

**The warm pool.** With `pool` > 0 (`agent.tool_pool`) the tool keeps that many fresh interpreters started
ahead of trajectories' first calls: a trajectory's first call takes one (it is taken out of the pool for good:
an interpreter serves one trajectory only, and is released with it), or starts its own when the pool is empty.
One background thread refills the pool, one start at a time, through a worker process of its own (so a pooled
start never holds up a call's); it begins when the first trajectory begins
(`prepare(state)`, called by the agent loop before the first turn, so the pool fills while the engines decode)
or at `warm()`. A waiting interpreter is nothing but the driver, started and idle, with the same sandbox and
limits as any other; where niceness can be lowered again (root), it is started (fork, sandbox set-up, Python's
start-up) at a niceness 10 above this process's, and set back to this process's when a trajectory takes it, so
refilling yields to the calls running meanwhile.

**Replay mode** (`replay`, `agent.python_replay`): every call starts a new interpreter that first re-runs the
trajectory's earlier cells silently, and stops it after the call (no pool, and each interpreter started by an
exec, as a one-shot sandbox run starts its code, by one worker per CPU): the same replies at a cost that grows
with the trajectory, kept as the reference the persistent interpreter is measured against
(`benchmarks/tools_step_time.py`).

**Failures.** A call's wall clock is capped at `timeout_s`, and while it runs the resident memory of its
sandbox's processes (those of its uid) is summed every 50 ms by one watch thread for all running calls, capped
at `memory_mb` (each process also has that address-space limit, so a large allocation raises MemoryError in
the cell and the interpreter lives on). A cell that hangs, crashes the interpreter, floods its output pipe or
goes over the memory cap costs that call an error reply, and the interpreter is killed; the trajectory's next
call starts a new one that first re-runs the trajectory's earlier successful cells, silently (then the cap is
`timeout_s` plus 1.5 x their own time), so its state is rebuilt once. A cell that raises is not kept among
those cells (a rebuild drops what it did before raising; the live interpreter keeps it); one whose output was
cut is. The cells live in `TrajectoryState.store["python"]`, so a trajectory continued elsewhere (a resumed
run, another process) rebuilds its interpreter the same way, once.

**Processes and uids.** The interpreters are started by worker processes (`workers`: by default four per CPU, at
most 16, since a start mostly waits on hand-overs between processes; started from the forkserver, one thread each),
so the sandbox's root-side setup runs in a child forked from a single-threaded process, never from this
multi-threaded one; a worker hands this process the interpreter's pipes and is asked again only to stop it. The
workers and their zygotes start at the tool's first `prepare()` (a run's agent loop calls it as the run begins), so
that a step's burst of first calls finds them ready. **Fast start**: where each interpreter gets a uid of its own
(root), a worker forks its interpreters from its zygote (`rl360.rewards.zygote`), a sandbox-interpreter process it
starts once that has already imported what the driver needs; the child applies the same sandbox set-up as the exec
path before it runs the driver, so an interpreter starts in a few milliseconds of CPU instead of a whole Python
start-up. A zygote that dies is replaced at the next start; where the fork path is not available (no uid switch), or
the zygote cannot start, interpreters are started by an exec (`start_session`). Each interpreter has its own uid,
`session_uid(slot)` of the worker that started it (a range apart from one-shot sandbox runs, unique across live
processes), so two trajectories never share a uid, a memory count or a sweep: one cannot see another's variables,
files or processes. Calls of many trajectories run side by side, each waiting on its own interpreter in a thread.

**Images in**: the trajectory's images (the prompt's, then those tools returned) are files `image_clue_0.png`,
`image_clue_1.jpg`, ... in the working directory, and, where PIL imports, PIL images `image_clue_0`, ...
(PyVision's names), each sent to the interpreter once, with the first call after it joined the trajectory.
**Variables in**: the prompt row's `extra_info.tools_kwargs.python.create_kwargs.variables` (a JSON object) are
bound as names before the first cell runs, e.g. `{"a": 123456, "b": 654321}` gives `a` and `b`. **Images
out**: PIL images `.show()`n, matplotlib figures left open, and image files the cell writes into the working
directory come back as images (resized by Qwen-VL's rule within max_pixels and charged to the trajectory's
image-token budget; past it they are dropped, with an error).

**Output**: what the cell prints (stdout and stderr, traceback included) up to `max_output_chars`; more is
cut and the call counts as an error. A call that raises, times out, runs out of memory or floods its pipe
returns an error reply, never an exception.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import io
import json
import multiprocessing
import os
import queue
import resource
import secrets
import select
import selectors
import signal
import subprocess
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rl360.agents.tools.base import ToolReply, ToolSettings, TrajectoryState, register_tool
from rl360.agents.tools.images import image_suffix, image_tokens, smart_resize

_DRIVER = r'''
import base64, contextlib, io, json, os, random, resource, sys, time, traceback
os.environ["MPLBACKEND"] = "Agg"
MARK = __MARK__
requests, replies = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
sys.stdin = open(os.devnull)

class Capture(io.TextIOBase):
    def __init__(self, limit):
        self.parts, self.kept, self.dropped, self.limit = [], 0, 0, limit
    def writable(self):
        return True
    def write(self, text):
        room = max(self.limit - self.kept, 0)
        self.parts.append(text[:room])
        self.kept += min(len(text), room)
        self.dropped += max(len(text) - room, 0)
        return len(text)

shown = []
scope = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    from PIL import Image
    Image.Image.show = lambda self, *a, **k: shown.append(self.copy())
except ImportError:
    Image = None

def close_figures(keep):
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    for number in plt.get_fignums():
        if keep:
            buffer = io.BytesIO()
            plt.figure(number).savefig(buffer, format="png")
            shown.append(buffer.getvalue())
        plt.close(number)

def cpu_cap(seconds):
    used = sum(os.times()[:2])
    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    want = int(used + seconds) + 1
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    try:
        resource.setrlimit(resource.RLIMIT_CPU, (want, hard))
    except (ValueError, OSError):
        pass

def run(source, out):
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            exec(compile(source, "<cell>", "exec"), scope)
            return ""
        except SystemExit as error:
            return "" if error.code in (None, 0) else "SystemExit: %r" % (error.code,)
        except BaseException as error:
            traceback.print_exception(type(error), error, error.__traceback__.tb_next)
            return "%s: %s" % (type(error).__name__, error)

def serve(request):
    result = {"output": "", "error": "", "dropped": 0, "images": [], "seconds": 0.0}
    if "seed" in request:
        random.seed(request["seed"])
    scope.update(request.get("variables") or {})
    for index, name, data in request.get("images", []):
        with open(name, "wb") as f:
            f.write(base64.b64decode(data))
        if Image is not None:
            scope["image_clue_%d" % index] = Image.open(name)
            scope["image_clue_%d" % index].load()
    cpu_cap(request["cpu_s"])
    for number, cell in enumerate(request.get("replay", [])):
        failure = run(cell, Capture(0))
        if failure:
            result["error"] = "an earlier cell (%d) failed when re-run: %s" % (number + 1, failure)
            result["replay_failed"] = True
            return result
    close_figures(False)
    del shown[:]
    before = {name: os.stat(name).st_mtime_ns for name in os.listdir(".") if os.path.isfile(name)}
    capture, started = Capture(request["limit"]), time.monotonic()
    result["error"] = run(request["code"], capture)
    result["seconds"] = time.monotonic() - started
    result["output"], result["dropped"] = "".join(capture.parts), capture.dropped
    close_figures(True)
    for name in sorted(os.listdir(".")):
        if (name.lower().endswith((".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")) and os.path.isfile(name)
                and before.get(name) != os.stat(name).st_mtime_ns):
            with open(name, "rb") as f:
                shown.append(f.read())
    for image in shown:
        if not isinstance(image, bytes):
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            image = buffer.getvalue()
        result["images"].append(base64.b64encode(image).decode())
    del shown[:]
    return result

replies.write((MARK + '"ready"' + "\n").encode())
replies.flush()
for line in requests:
    reply = serve(json.loads(line))
    replies.write((MARK + json.dumps(reply) + "\n").encode())
    replies.flush()
'''

_STORE = "python"  # TrajectoryState.store key: {"cells": [...], "seconds": [...]}
_MAX_IMAGES = 8  # images one call may return
_CALL_THREADS = 256  # calls in flight at once (each waits on its interpreter in a thread)
_SESSION_CPU_CALLS = 64  # an interpreter's CPU-time limit: this many calls' timeout_s


def driver(mark: str) -> str:
    """The script a persistent interpreter runs: it answers each JSON line on stdin (a cell, and for a new
    interpreter the seed, variables and cells to replay; images not sent before) with `mark` and a JSON
    line on stdout."""
    return _DRIVER.replace("__MARK__", repr(mark), 1)


@dataclass(eq=False)
class _Session:
    """One trajectory's live interpreter: the worker that started it and its slot there, its pid and uid, our
    ends of its pipes, the marker of its replies; how many of the trajectory's images and cells it holds."""

    worker: _Worker
    slot: int
    pid: int
    uid: int | None
    write_fd: int
    read_fd: int
    mark: bytes
    memory_bytes: int
    images: int = 0
    cells: int = -1  # -1: not built yet (the first call replays the trajectory's cells)
    exceeded: bool = False  # the memory watch found it over memory_bytes
    busy: bool = False
    released: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def exchange(self, request: dict[str, Any], timeout_s: float, max_bytes: int,
                 watch: _MemoryWatch) -> tuple[bytes, bytes | None, str | None]:
        """Send `request`, read until the reply: (what came before the reply's marker, the reply's JSON or
        None, None or why it stopped: "timeout", "output", "memory", "exited")."""
        _drain(self.read_fd)
        data = (json.dumps(request) + "\n").encode()
        deadline = time.monotonic() + timeout_s
        buffer = bytearray()
        watch.add(self)
        try:
            try:
                _write_all(self.write_fd, data, deadline)
            except TimeoutError:
                return b"", None, "timeout"
            except OSError:
                return b"", None, "exited"
            with selectors.DefaultSelector() as selector:
                selector.register(self.read_fd, selectors.EVENT_READ)
                while True:
                    if self.exceeded:
                        return bytes(buffer), None, "memory"
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return bytes(buffer), None, "timeout"
                    if not selector.select(min(left, _WAKE_S)):
                        continue
                    try:
                        chunk = os.read(self.read_fd, 1 << 16)
                    except BlockingIOError:
                        continue
                    except OSError:
                        chunk = b""
                    if not chunk:
                        return bytes(buffer), None, "exited"
                    searched = max(len(buffer) - len(self.mark), 0)
                    buffer += chunk
                    if len(buffer) > max_bytes:
                        return bytes(buffer[:max_bytes]), None, "output"
                    while (found := buffer.find(self.mark, searched)) >= 0:
                        end = buffer.find(b"\n", found + len(self.mark))
                        if end < 0:
                            break
                        if buffer[found + len(self.mark):end] != _READY:
                            return bytes(buffer[:found]), bytes(buffer[found + len(self.mark):end]), None
                        del buffer[found:end + 1]  # the start-up line of an interpreter started for this call
                        searched = found
        finally:
            watch.remove(self)

    def close_pipes(self) -> None:
        for fd in (self.write_fd, self.read_fd):
            try:
                os.close(fd)
            except OSError:
                pass


_READY = b'"ready"'  # what an interpreter writes after its marker once it has started, before any request
_WAKE_S = 0.05  # how often a waiting call looks at the memory watch's verdict


def _drain(fd: int) -> None:
    """Drop what the interpreter wrote between calls (a thread or process of an earlier cell)."""
    while True:
        try:
            if not os.read(fd, 1 << 16):
                return
        except (BlockingIOError, OSError):
            return


MAX_DEFAULT_WORKERS = 16  # worker processes the python tool starts unless agent.tool_workers says
_POOL_NICE = 10  # added to the niceness of a warm interpreter (from its fork) until a trajectory takes it


def _renice(session: _Session, niceness: int) -> None:
    """Set the niceness of every process of the interpreter's uid (root only: elsewhere a pooled interpreter is
    started without a niceness of its own)."""
    if session.uid is None or os.geteuid() != 0:
        return
    try:
        os.setpriority(os.PRIO_USER, session.uid, niceness)
    except OSError:
        pass


def _await_ready(session: _Session, timeout_s: float) -> bool:
    """Wait until the new interpreter `session` has started (its start-up line read); whether it did."""
    deadline, buffer = time.monotonic() + timeout_s, bytearray()
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([session.read_fd], [], [], left)
        if not readable:
            continue
        try:
            chunk = os.read(session.read_fd, 1 << 16)
        except BlockingIOError:
            continue
        except OSError:
            return False
        if not chunk:
            return False
        buffer += chunk
        if session.mark + _READY + b"\n" in buffer:
            return True
    return False


def _idle_alive(fd: int) -> bool:
    """Whether the idle interpreter whose stdout is `fd` still runs (its pipe is not at end of file)."""
    readable, _, _ = select.select([fd], [], [], 0)
    if not readable:
        return True
    try:
        return bool(os.read(fd, 1 << 16))
    except BlockingIOError:
        return True
    except OSError:
        return False


def _write_all(fd: int, data: bytes, deadline: float) -> None:
    view = memoryview(data)
    while view:
        _, writable, _ = select.select([], [fd], [], max(deadline - time.monotonic(), 0))
        if not writable:
            raise TimeoutError
        try:
            view = view[os.write(fd, view[: 1 << 16]):]
        except BlockingIOError:
            continue


class _MemoryWatch:
    """One thread that, while calls run, sums the resident memory of each running call's sandbox (the
    processes of its uid; without one, this user's processes in its session) in one scan of /proc every
    `_MEMORY_CHECK_S` (less often where a scan is slow: at most ~5% of a core) and flags those over their cap."""

    def __init__(self) -> None:
        self._watched: dict[_Session, int] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, session: _Session) -> None:
        with self._cond:
            self._watched[session] = self._watched.get(session, 0) + 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="rl360-python-memory", daemon=True)
                self._thread.start()
            self._cond.notify()

    def remove(self, session: _Session) -> None:
        with self._cond:
            if self._watched.get(session, 0) <= 1:
                self._watched.pop(session, None)
            else:
                self._watched[session] -= 1

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._watched:
                    self._cond.wait()
                watched = list(self._watched)
            started = time.monotonic()
            try:
                totals = _resident(watched)
            except OSError:  # /proc unreadable for a moment: the next round counts
                totals = {}
            for session, total in totals.items():
                if total > session.memory_bytes:
                    session.exceeded = True
            spent = time.monotonic() - started
            time.sleep(max(_MEMORY_CHECK_S, 20 * spent) - spent)


_MEMORY_CHECK_S = 0.05


def _resident(sessions: list[_Session]) -> dict[_Session, int]:
    """Resident bytes of each session's processes (a page shared by several counts in each)."""
    by_uid = {session.uid: session for session in sessions if session.uid is not None}
    by_sid = {session.pid: session for session in sessions if session.uid is None}
    me, page = os.geteuid(), resource.getpagesize()
    totals = dict.fromkeys(sessions, 0)
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                owner = entry.stat().st_uid
                session = by_uid.get(owner)
                if session is None and by_sid and owner == me:
                    session = by_sid.get(os.getsid(int(entry.name)))
                if session is None:
                    continue
                with open(f"/proc/{entry.name}/statm", "rb") as handle:
                    totals[session] += int(handle.read().split()[1]) * page
            except (OSError, ValueError, IndexError):  # it exited meanwhile
                continue
    return totals


class _Worker:
    """A worker process (started from the forkserver, one thread) that starts and stops sandboxed interpreters
    and hands us their pipes: the sandbox's root-side setup (namespaces, mounts, the uid switch) runs in a
    child forked from it, never from this multi-threaded process. Requests go one at a time."""

    def __init__(self) -> None:
        ours, theirs = multiprocessing.Pipe(duplex=True)
        self.process = _mp_context().Process(target=_worker_main, args=(theirs,), daemon=True,
                                             name="rl360-python-worker")
        self.process.start()
        theirs.close()
        self.conn = ours
        self.lock = threading.Lock()
        self.sessions = 0
        self.alive = True

    def start(self, python: str, script: str, limits: Any, niceness: int = 0,
              fork: bool = True) -> tuple[int, int, int | None, int, int] | str:
        """A new interpreter: (slot, pid, uid, our write end of its stdin, our read end of its stdout), or why
        it could not start; `niceness` added to its processes' (from its fork on) where it can be taken back;
        `fork`: forked from the worker's zygote where that is available (else started by an exec)."""
        from multiprocessing.reduction import recv_handle

        with self.lock:
            try:
                self.conn.send(("start", python, script, limits, _sandbox_environ(), niceness, fork))
                reply = self.conn.recv()
                if reply[0] != "ok":
                    return reply[1]
                fds = [recv_handle(self.conn), recv_handle(self.conn)]
            except (OSError, EOFError):
                self.alive = False
                return "the tool's worker process died; call again"
        for fd in fds:
            os.set_inheritable(fd, False)
            os.set_blocking(fd, False)
        _, slot, pid, uid = reply
        return slot, pid, uid, fds[0], fds[1]

    def prime(self, python: str) -> None:
        """Start the worker's zygote for `python` ("": the sandbox's) ahead of its first interpreter."""
        with self.lock:
            try:
                self.conn.send(("prime", python, _sandbox_environ()))
                self.conn.recv()
            except (OSError, EOFError):
                self.alive = False

    def stop(self, slot: int) -> int | None:
        """Kill the interpreter in `slot` and every process of its uid, delete its directory; its exit status."""
        with self.lock:
            try:
                self.conn.send(("stop", slot))
                return self.conn.recv()[1]
            except (OSError, EOFError):
                self.alive = False
                return None

    def close(self) -> None:
        with self.lock:
            self.alive = False
            self.conn.close()  # the worker stops its interpreters and exits
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _worker_main(conn: Any) -> None:
    """A worker: serve start/stop requests until the connection closes (or SIGTERM), then stop every
    interpreter it started."""
    from multiprocessing.reduction import send_handle

    from rl360.rewards.sandbox import SESSION_SLOTS, IsolationError, sandbox_python

    children: dict[int, Any] = {}
    zygotes = _Zygotes()

    def terminate(*_: Any) -> None:
        """SIGTERM (multiprocessing ends its daemon children so at exit): stop the interpreters and exit here and
        now; an exception raised instead could land where Python ignores it (a fork's handlers) and leave this
        worker waiting on its connection while the parent waits for it."""
        for child in list(children.values()):
            try:
                child.stop()
            except Exception:
                pass
        os._exit(0)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, terminate)
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            if message[0] == "stop":
                child = children.pop(message[1], None)
                if child is not None:
                    child.stop()
                conn.send(("ok", None if child is None else child.process.returncode))
                continue
            if message[0] == "prime":  # the zygote started ahead of the first interpreter
                _take_environ(message[2])
                zygotes.prime(message[1] or sandbox_python())
                conn.send(("ok",))
                continue
            _, python, script, limits, environ, niceness, fork = message
            _take_environ(environ)
            slot = next((slot for slot in range(SESSION_SLOTS) if slot not in children), None)
            try:
                if slot is None:
                    raise ValueError(f"this worker already runs {SESSION_SLOTS} interpreters")
                python = python or sandbox_python()
                if python is None:
                    raise ValueError("no Python interpreter runs inside the sandbox here")
                child = _start_child(zygotes, python, script, limits, slot, niceness, fork)
            except (IsolationError, OSError, ValueError, subprocess.SubprocessError) as error:
                conn.send(("error", str(error)))
                continue
            children[slot] = child
            conn.send(("ok", slot, child.process.pid, child.uid))
            send_handle(conn, child.process.stdin.fileno(), 0)
            send_handle(conn, child.process.stdout.fileno(), 0)
            child.process.stdin.close()
            child.process.stdout.close()
    finally:
        for child in children.values():
            child.stop()
        zygotes.close()


class _Zygotes:
    """A worker's zygotes, one per interpreter path, each started at its first use (or primed ahead of it): `get`
    gives the live one, replacing one that died, or None where the fork path is not available or its zygote
    failed to start (the exec path from then on)."""

    def __init__(self):
        self._by_python: dict[str, Any] = {}  # None: the fork path failed for that interpreter

    def prime(self, python: str | None) -> None:
        if python is not None and python not in self._by_python:
            self.get(python)

    def get(self, python: str) -> Any:
        from rl360.rewards import zygote as forked

        if not forked.available():
            return None
        zygote = self._by_python.get(python)
        if zygote is not None and not zygote.alive:
            zygote.close()  # it died: its children live on until stopped (from here), a new one forks from now on
            del self._by_python[python]
        if python not in self._by_python:
            try:
                self._by_python[python] = forked.Zygote(python)
            except (OSError, subprocess.SubprocessError):
                self._by_python[python] = None
        return self._by_python[python]

    def drop(self, python: str) -> None:
        """The zygote for `python` failed a start: closed, a new one at the next start."""
        zygote = self._by_python.pop(python, None)
        if zygote is not None:
            zygote.close()

    def close(self) -> None:
        for zygote in self._by_python.values():
            if zygote is not None:
                zygote.close()


def _take_environ(environ: dict[str, str | None]) -> None:
    for name, value in environ.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _start_child(zygotes: _Zygotes, python: str, script: str, limits: Any, slot: int, niceness: int,
                 fork: bool) -> Any:
    """A new sandboxed interpreter running `script` in `slot`: forked from this worker's zygote for `python`
    (started at the first such call) where `fork` is asked and the fork path is available, else started by
    `start_session` (an exec of `python`); `niceness` added to its processes' where it can be taken back."""
    from rl360.rewards import zygote as forked
    from rl360.rewards.sandbox import start_session

    zygote = zygotes.get(python) if fork else None
    if zygote is not None:
        try:
            return zygote.start(script, {"driver.py": script}, limits, slot, niceness if os.geteuid() == 0 else 0)
        except forked.ZygoteError:
            zygotes.drop(python)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if niceness and os.geteuid() == 0:  # the child inherits it from its fork; this worker takes it back
        os.setpriority(os.PRIO_PROCESS, 0, min(base + niceness, 19))
    try:
        return start_session([python, "-I", "-B", "driver.py"], {"driver.py": script}, limits, slot)
    finally:
        if niceness and os.geteuid() == 0:
            os.setpriority(os.PRIO_PROCESS, 0, base)


@register_tool("python")
class PythonTool:
    name = "python"
    manages_timeout = True  # its interpreter has its own wall-clock cap per call (the loop adds none)
    schema = {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code, e.g. to crop, enhance or measure the images (image_clue_0, ... as PIL "
                           "images and files). Variables persist between calls. Print what you need to see; "
                           "images you .show(), plot or save come back to you.",
            "parameters": {"type": "object",
                           "properties": {"code": {"type": "string", "description": "The Python code to run."}},
                           "required": ["code"]},
        },
    }

    def __init__(self, settings: ToolSettings):
        self.settings = settings
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()  # held while a worker process starts
        self._workers: list[_Worker] = []
        self._sessions: dict[int, _Session] = {}  # id(TrajectoryState) -> its interpreter
        self._threads: ThreadPoolExecutor | None = None
        self._watch = _MemoryWatch()
        self._dropped: queue.SimpleQueue = queue.SimpleQueue()  # interpreters of collected states, to stop
        self._reaper: threading.Thread | None = None
        self._pool: collections.deque[_Session] = collections.deque()  # warm interpreters, no trajectory's yet
        self._pool_cond = threading.Condition()
        self._filler: threading.Thread | None = None
        # the filler's own worker process: a niced start there never holds up a call's start in another worker
        self._pool_worker: _Worker | None = None
        self._generation = 0  # close() ends the filler of the generation before
        self._primer: threading.Thread | None = None  # starts the workers ahead of the first calls
        self._primed = 0  # close() ends the primer of the generation before

    async def call(self, arguments: dict[str, Any], state: TrajectoryState) -> ToolReply:
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            return ToolReply(error="the python tool needs a non-empty string argument 'code'")
        return await asyncio.get_running_loop().run_in_executor(self._executor(), self.run, code, state)

    def run(self, code: str, state: TrajectoryState) -> ToolReply:
        """Run `code` as the trajectory's next cell in its interpreter (started, with the trajectory's earlier
        cells replayed, when it has none); the reply."""
        from rl360.rewards.sandbox import _signal_name
        from rl360.rewards.zygote_main import SETUP_FAILED

        memory = state.store.setdefault(_STORE, {"cells": [], "seconds": []})
        variables = state.kwargs.get(self.name, {}).get("variables") or {}
        if not isinstance(variables, dict) or not all(isinstance(key, str) and key.isidentifier() for key in variables):
            return ToolReply(error="the row's tools_kwargs.python.create_kwargs.variables must map Python names to "
                                   "values")
        session = self._session(state)
        if not isinstance(session, str) and session.cells not in (-1, len(memory["cells"])):
            self._end(state, session)  # its state is not the trajectory's (the store was replaced): start over
            session = self._session(state)
        if isinstance(session, str):
            return ToolReply(error=f"the code was not run: {session}")
        request: dict[str, Any] = {"code": code, "limit": self.settings.max_output_chars}
        timeout = self.settings.timeout_s
        if session.cells != len(memory["cells"]):  # a new interpreter: the trajectory's state rebuilt first
            request.update(seed=state.seed, variables=variables, replay=memory["cells"])
            timeout += 1.5 * sum(memory["seconds"])
        request["cpu_s"] = timeout
        request["images"] = [(i, f"image_clue_{i}{image_suffix(data)}", base64.b64encode(data).decode())
                             for i, data in enumerate(state.images) if i >= session.images]
        max_bytes = max(4 * self.settings.max_output_chars, 32 << 20)
        with session.lock:
            session.busy = True
        try:
            head, envelope, stopped = session.exchange(request, timeout, max_bytes, self._watch)
        finally:
            with session.lock:
                session.busy = False
                if session.released:
                    session.close_pipes()
        stray = head.decode("utf-8", "replace")
        if envelope is None:  # the interpreter is stopped, or dead: the next call starts a new one
            status = self._end(state, session)
            if stray.startswith(SETUP_FAILED):  # a forked interpreter whose sandbox could not be set up
                return ToolReply(error=f"the code was not run: {stray[len(SETUP_FAILED):].strip()}")
            if stopped == "timeout":
                return ToolReply(_tail(stray, self.settings.max_output_chars),
                                 error=f"the code ran past the time limit of {self.settings.timeout_s:g} s and was "
                                       "stopped", timed_out=True)
            why = (f"it used more than the memory limit of {self.settings.memory_mb} MB" if stopped == "memory"
                   else "it wrote more output than allowed" if stopped == "output"
                   else f"it exited with status {status} {_signal_name(status) or ''}")
            return ToolReply(_tail(stray, self.settings.max_output_chars), error=f"the code was stopped: {why.strip()}")
        try:
            report = json.loads(envelope)
        except json.JSONDecodeError:
            self._end(state, session)
            return ToolReply(error="the code's result could not be read (did it write to the real stdout?)")
        session.images = len(state.images)
        text, error = report["output"], report["error"]
        if report.get("replay_failed"):
            session.cells = -1  # its state is not the trajectory's: the next call starts over
            self._end(state, session)
        else:
            if not error:  # it ran through (even if its output or images are cut below): later calls see its state
                memory["cells"].append(code)
                memory["seconds"].append(report["seconds"])
            session.cells = len(memory["cells"])
        if self.settings.replay and not session.released:  # the reference mode: no interpreter outlives its call
            self._end(state, session)
        if stray.strip():  # what bypassed sys.stdout (os.write, subprocesses)
            text = (text + stray)[: self.settings.max_output_chars]
        if report["dropped"]:
            text += f"\n... [{report['dropped']} more characters of output cut]"
            error = error or (f"the output was longer than {self.settings.max_output_chars} characters and was cut; "
                              "print less")
        images, refused = self._images(report["images"], state)
        if refused:
            error = error or refused
        return ToolReply(text, tuple(images), error)

    def interpreter_pid(self, state: TrajectoryState) -> int | None:
        """The pid of the trajectory's live interpreter (None when it has none)."""
        with self._lock:
            session = self._sessions.get(id(state))
        return None if session is None else session.pid

    def release(self, state: TrajectoryState) -> None:
        """The trajectory ended: stop its interpreter (in the background; its processes are killed, its uid
        swept and its directory deleted a moment later)."""
        with self._lock:
            session = self._sessions.pop(id(state), None)
        if session is not None:
            self._discard(session, wait=False)

    def close(self) -> None:
        """Stop every interpreter and the worker processes (a later call starts new ones)."""
        with self._lock:
            workers, self._workers = self._workers, []
            self._primer, self._primed = None, self._primed + 1
            sessions, self._sessions = list(self._sessions.values()), {}
            threads, self._threads = self._threads, None
            reaper, self._reaper = self._reaper, None
        if reaper is not None:
            self._dropped.put(None)
        with self._pool_cond:
            self._generation += 1
            self._filler = None
            if self._pool_worker is not None:
                workers.append(self._pool_worker)
                self._pool_worker = None
            sessions += list(self._pool)
            self._pool.clear()
            self._pool_cond.notify_all()
        for session in sessions:
            self._discard(session, wait=True)
        for worker in workers:
            worker.close()
        if threads is not None:
            threads.shutdown(wait=False)

    def _session(self, state: TrajectoryState) -> _Session | str:
        """The trajectory's interpreter: its own, else a fresh one from the warm pool, else one started now; or
        why none could be started."""
        key = id(state)
        with self._lock:
            session = self._sessions.get(key)
            if session is not None and session.worker.alive:
                return session
            if session is not None:  # its worker died, and the interpreter with it
                del self._sessions[key]
                session.close_pipes()
        session = None if self.settings.replay else self._pooled()
        if session is None:
            started = self._start()
            if isinstance(started, str):
                return started
            session = started
        with self._lock:
            self._sessions[key] = session
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name="rl360-python-reaper", daemon=True)
                self._reaper.start()
        weakref.finalize(state, self._forget, key, session)
        return session

    def _start(self, niceness: int = 0, worker: _Worker | None = None) -> _Session | str:
        """A new interpreter, belonging to no trajectory yet (started at `niceness` by `worker`, for the pool; by
        default in the least busy worker); or why it could not start."""
        from rl360.rewards.sandbox import SandboxLimits

        if worker is None:
            worker = self._worker()
        else:
            with self._lock:
                worker.sessions += 1
        mark = "\n@@rl360-python-" + secrets.token_hex(16) + "@@"
        limits = SandboxLimits(timeout_s=self.settings.timeout_s, memory_bytes=self.settings.memory_mb << 20,
                               cpu_s=int(self.settings.timeout_s * _SESSION_CPU_CALLS) + 1)
        started = worker.start(self.settings.python, driver(mark), limits, niceness, fork=not self.settings.replay)
        if isinstance(started, str):
            with self._lock:
                worker.sessions -= 1
            return started
        slot, pid, uid, write_fd, read_fd = started
        return _Session(worker, slot, pid, uid, write_fd, read_fd, mark.encode(), limits.memory_bytes)

    def _wanted_workers(self) -> int:
        """`workers`, else four per CPU (at most `MAX_DEFAULT_WORKERS`): a start mostly waits on its hand-overs
        between processes, so a burst of first calls (every trajectory of a step at once) needs more starts in
        flight than there are cores. Replay mode, the reference, starts its interpreters by an exec in one
        worker per CPU, started as calls need them."""
        cpus = os.cpu_count() or 1
        return self.settings.workers or (cpus if self.settings.replay else min(4 * cpus, MAX_DEFAULT_WORKERS))

    def prepare(self, state: TrajectoryState | None = None) -> None:
        """A trajectory begins (the agent loop calls this before its first turn): the workers and their zygotes
        start, once, and the warm pool starts filling, if it is not full, while the engines decode."""
        if self.settings.replay:
            return
        with self._lock:
            primer, self._primer = self._primer, self._primer or threading.Thread(
                target=self._start_workers, args=(self._primed,), name="rl360-python-workers", daemon=True)
        if primer is None:
            self._primer.start()
        if self.settings.pool <= 0:
            return
        with self._pool_cond:
            if self._filler is None:
                self._filler = threading.Thread(target=self._fill, args=(self._generation,),
                                                name="rl360-python-pool", daemon=True)
                self._filler.start()
            self._pool_cond.notify_all()

    def warm(self, timeout_s: float = 60.0) -> int:
        """Start filling the warm pool and wait (at most `timeout_s`) until it holds `pool` interpreters; how many
        it holds."""
        self.prepare()
        deadline = time.monotonic() + timeout_s
        with self._pool_cond:
            while len(self._pool) < self.settings.pool and time.monotonic() < deadline:
                self._pool_cond.wait(max(min(deadline - time.monotonic(), 0.5), 0))
            return len(self._pool)

    def _start_workers(self, generation: int) -> None:
        """Every worker started, then their zygotes side by side (what the first burst of calls would otherwise
        wait for); calls may take a worker as soon as it is listed."""
        started = []
        while True:
            with self._lock:
                if self._primed != generation or sum(w.alive for w in self._workers) >= self._wanted_workers():
                    break
            worker = _Worker()
            with self._lock:
                if self._primed != generation:
                    worker.close()  # the tool closed meanwhile
                    return
                self._workers.append(worker)
            started.append(worker)
        primers = [threading.Thread(target=worker.prime, args=(self.settings.python,), daemon=True)
                   for worker in started]
        for primer in primers:
            primer.start()
        for primer in primers:
            primer.join()

    def pooled_pids(self) -> list[int]:
        """The pids of the warm pool's interpreters (started, belonging to no trajectory)."""
        with self._pool_cond:
            return [session.pid for session in self._pool]

    def _pooled(self) -> _Session | None:
        """A fresh interpreter from the warm pool (taken out of it for good; the pool refills in the background),
        or None when it has none alive."""
        if self.settings.pool <= 0:
            return None
        while True:
            with self._pool_cond:
                session = self._pool.popleft() if self._pool else None
                self._pool_cond.notify_all()
            if session is None:
                self.prepare()
                return None
            if session.worker.alive and _idle_alive(session.read_fd):
                _renice(session, os.getpriority(os.PRIO_PROCESS, 0))  # this process's own
                return session
            self._discard(session, wait=False)  # it died while waiting: never handed out

    def _fill(self, generation: int) -> None:
        """The warm pool's thread: keep `pool` fresh interpreters started, one start at a time, until `close()`."""
        failures = 0
        while True:
            with self._pool_cond:
                while self._generation == generation and len(self._pool) >= self.settings.pool:
                    self._pool_cond.wait()
                if self._generation != generation:
                    return
            try:
                with self._pool_cond:
                    if self._pool_worker is None or not self._pool_worker.alive:
                        self._pool_worker = _Worker()
                    worker = self._pool_worker
                started = self._start(_POOL_NICE, worker)
            except Exception as error:  # e.g. a worker process that cannot start: calls report it themselves
                started = str(error)
            if isinstance(started, str):  # the sandbox refused: calls report why; retry later
                failures += 1
                time.sleep(min(0.1 * 2 ** failures, 10.0))
                continue
            if not _await_ready(started, max(self.settings.timeout_s, 60.0)):
                self._discard(started, wait=True)
                failures += 1
                time.sleep(min(0.1 * 2 ** failures, 10.0))
                continue
            failures = 0
            with self._pool_cond:
                if self._generation == generation:
                    self._pool.append(started)
                    self._pool_cond.notify_all()
                    continue
            self._discard(started, wait=True)
            return

    def _worker(self) -> _Worker:
        """The worker to start an interpreter in (its count taken): the least busy one with room, a new one
        while there are fewer than `workers` and none is idle, or when all are full. Started outside the tool's
        lock (it takes a moment), one at a time."""
        from rl360.rewards.sandbox import SESSION_SLOTS

        def pick(may_wait: bool) -> _Worker | None:
            with self._lock:
                self._workers = [worker for worker in self._workers if worker.alive]
                room = [worker for worker in self._workers if worker.sessions < SESSION_SLOTS]
                best = min(room, key=lambda worker: worker.sessions, default=None)
                wanted = self._wanted_workers()
                if best is not None and (best.sessions == 0 or len(self._workers) >= wanted or may_wait):
                    best.sessions += 1
                    return best
            return None

        best = pick(False)
        if best is not None:
            return best
        if not self._start_lock.acquire(blocking=False):  # another call is starting one: take what is there
            best = pick(True)
            if best is not None:
                return best
            self._start_lock.acquire()
        try:
            best = pick(False)
            if best is not None:
                return best
            worker = _Worker()
            with self._lock:
                self._workers.append(worker)
                worker.sessions += 1
            return worker
        finally:
            self._start_lock.release()

    def _forget(self, key: int, session: _Session) -> None:
        """The trajectory's state was garbage-collected without a release: its interpreter is stopped by the
        reaper thread (a weakref callback may run inside any code of this process, even under our lock, so it
        only puts it on a queue whose put is safe there)."""
        self._dropped.put((key, session))

    def _reap(self) -> None:
        while True:
            item = self._dropped.get()
            if item is None:
                return
            key, session = item
            with self._lock:
                if self._sessions.get(key) is not session:
                    continue
                del self._sessions[key]
            try:
                self._discard(session, wait=True)
            except Exception:  # a worker gone meanwhile: nothing left to stop
                pass

    def _end(self, state: TrajectoryState, session: _Session) -> int | None:
        """Stop the trajectory's interpreter after a failed call; its exit status."""
        with self._lock:
            if self._sessions.get(id(state)) is session:
                del self._sessions[id(state)]
        return self._discard(session, wait=True)

    def _discard(self, session: _Session, wait: bool) -> int | None:
        with session.lock:
            if session.released:
                return None
            session.released = True
            if not session.busy:
                session.close_pipes()

        def stop() -> int | None:
            status = session.worker.stop(session.slot)
            with self._lock:
                session.worker.sessions -= 1
            return status

        if wait:
            return stop()
        threading.Thread(target=stop, name="rl360-python-release", daemon=True).start()
        return None

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._threads is None:
                self._threads = ThreadPoolExecutor(_CALL_THREADS, thread_name_prefix="rl360-python")
            return self._threads

    def _images(self, encoded: list[str], state: TrajectoryState) -> tuple[list[bytes], str]:
        """The images a cell returned, resized and charged to the budget; why some were dropped ("" if none)."""
        from PIL import Image

        images, dropped = [], 0
        for data in encoded[:_MAX_IMAGES]:
            try:
                image = Image.open(io.BytesIO(base64.b64decode(data)))
                image.load()
            except Exception:  # an unreadable file the code wrote: not an image after all
                continue
            tokens = image_tokens(image.height, image.width, self.settings.min_pixels, self.settings.max_pixels)
            if state.image_tokens + tokens > self.settings.max_image_tokens:
                dropped += 1
                continue
            state.image_tokens += tokens
            height, width = smart_resize(image.height, image.width, self.settings.min_pixels, self.settings.max_pixels)
            buffer = io.BytesIO()
            image.convert("RGB").resize((width, height), Image.Resampling.BICUBIC).save(buffer, format="PNG")
            images.append(buffer.getvalue())
        dropped += max(len(encoded) - _MAX_IMAGES, 0)
        why = (f"{dropped} image(s) were not returned: the image budget of this conversation "
               f"({self.settings.max_image_tokens} tokens) or the limit of {_MAX_IMAGES} images per call was reached"
               if dropped else "")
        return images, why


def _mp_context() -> multiprocessing.context.BaseContext:
    return multiprocessing.get_context("forkserver" if "forkserver" in multiprocessing.get_all_start_methods()
                                       else "spawn")


def _sandbox_environ() -> dict[str, str | None]:
    """This process's sandbox settings (RL360_SANDBOX_ISOLATION, ..._REQUIRE_ISOLATION), for a worker to run with:
    workers are forked from a server started earlier, with the environment of that time."""
    from rl360.rewards.sandbox import ISOLATION_ENV, REQUIRE_ENV

    return {name: os.environ.get(name) for name in (ISOLATION_ENV, REQUIRE_ENV)}


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "... " + text[-limit:]
