"""Run untrusted Python code in a sandboxed subprocess (for `codegen` rewards).

`run_python(code, stdin)` writes `code` to a fresh temporary directory, runs it there with the
interpreter from `sandbox_python()` and returns a `SandboxResult`. What holds, on Linux:

- **Own directory.** cwd, HOME and TMPDIR are a new temporary directory (mode 0700), deleted afterwards.
- **Unprivileged uid** (when this process is root, or can otherwise change uid). The child runs as a
  uid of its own, `UID_BASE + (this process's pid % UID_SPAN)`, with no supplementary groups, so one
  sandbox per process at a time never shares a uid with another: file permissions then stop writes
  outside world-writable places, it cannot signal or ptrace host processes, RLIMIT_NPROC counts
  only its own processes, and after the run every process of that uid is killed (even ones that left
  the process group with setsid). Without uid switching the child runs as this process's user and
  those protections are absent (`SandboxResult.uid_isolated` is False).
- **No network.** The child calls unshare(CLONE_NEWUSER | CLONE_NEWNET) before exec: a new network
  namespace has only a down loopback device. Whether the kernel allows it is probed once per process
  (`network_isolation_available()`); where it does not, code runs with the host network and
  `SandboxResult.network_isolated` is False.
- **Limits** (resource.setrlimit in the child): CPU seconds, address space, file size, processes
  (RLIMIT_NPROC, only meaningful with its own uid), open files, no core files; PR_SET_NO_NEW_PRIVS.
- **Wall-clock timeout**: the child gets its own session and process group; past `timeout_s` the group
  (and, with its own uid, every process of that uid) is SIGKILLed.
- **Scrubbed environment**: a minimal PATH, HOME/TMPDIR in the sandbox, PYTHONDONTWRITEBYTECODE; no
  variable of this process is inherited. The interpreter runs with -I (isolated) and -B.
- **Bounded output**: stdout and stderr are captured up to `max_output_bytes` each; past that the
  child is killed and `output_truncated` is set.

What does not hold: the filesystem is the host's, so the code can read any world-readable file and
write to world-writable directories (/tmp, /dev/shm) within RLIMIT_FSIZE per file; disk use across many
files is not bounded; memory is bounded per process (RLIMIT_AS), not in total (no cgroup), so
`max_processes` x `memory_bytes` is the real ceiling; there is no seccomp filter and no PID or mount
namespace. If the caller itself is killed mid-run (e.g. by the reward pool's timeout), the direct child
dies with it (PR_SET_PDEATHSIG) but its own children are not swept.

Process creation uses `preexec_fn` (resource limits, unshare, prctl) after the uid change that
`subprocess` performs itself; in a multi-threaded parent a child could in principle deadlock before
exec, which then costs one wall-clock timeout, never a hang.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cache

UID_BASE = 1 << 30  # sandbox uids: far above any real account, below 2**32 - 1
UID_SPAN = 1 << 23  # > pid_max (2**22 on 64-bit Linux): distinct live processes get distinct uids
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_NO_NEW_PRIVS = 38
PR_SET_PDEATHSIG = 1
MINIMAL_PATH = "/usr/local/bin:/usr/bin:/bin"
_KILL_ROUNDS = 5  # kill(-1) rounds when sweeping a sandbox uid
_DRAIN_AFTER_EXIT_S = 0.2  # how long output is still read once the child exited (a grandchild may hold the pipes)


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. `cpu_s` defaults to the wall-clock timeout rounded up, plus one second."""

    timeout_s: float = 5.0
    cpu_s: int | None = None
    memory_bytes: int = 2 << 30  # RLIMIT_AS of each process
    file_size_bytes: int = 64 << 20  # RLIMIT_FSIZE: largest file the code may write
    max_processes: int = 16  # RLIMIT_NPROC: processes of the sandbox uid (of this user without one)
    max_open_files: int = 256  # RLIMIT_NOFILE
    max_output_bytes: int = 8 << 20  # per stream (stdout, stderr)


@dataclass
class SandboxResult:
    """How one run ended.

    `returncode` is the exit status (negative: killed by that signal, named in `killed_by_signal`);
    `timed_out` means the wall-clock limit killed it; `output_truncated` that stdout or stderr passed
    the cap and the child was killed; `error` that it could not be started at all (then returncode is
    None). `uid_isolated` / `network_isolated` say which isolation applied.
    """

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    killed_by_signal: str | None = None
    output_truncated: bool = False
    wall_s: float = 0.0
    uid_isolated: bool = False
    network_isolated: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Exited by itself with status 0, within every limit."""
        return self.returncode == 0 and not self.timed_out and not self.output_truncated and self.error is None


def run_python(code: str, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a Python script in the sandbox, `stdin` fed to it; see the module docstring."""
    limits = limits or SandboxLimits()
    python = sandbox_python()
    if python is None:
        return SandboxResult(None, "", "", error="no Python interpreter can be run inside the sandbox")
    return _run([python, "-I", "-B", "solution.py"], {"solution.py": code}, stdin, limits)


def run_command(argv: list[str], files: dict[str, str] | None = None, stdin: str = "",
                limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `argv` in the sandbox with `files` (name -> text) written into its directory first."""
    return _run(argv, files or {}, stdin, limits or SandboxLimits())


def sandbox_uid() -> int | None:
    """The uid sandboxes started by this process run as, or None when this process cannot change uid."""
    return _uid_for(os.getpid())


def network_isolation_available() -> bool:
    """Whether a child (as the sandbox uid) can enter new user and network namespaces (probed once)."""
    return _probe_network(os.getpid())


@cache
def sandbox_python() -> str | None:
    """The first interpreter that runs inside the sandbox: this one, else python3 on the minimal PATH
    (the sandbox uid may not reach this one, e.g. a virtualenv under /root)."""
    candidates = [sys.executable] + [os.path.join(d, "python3") for d in MINIMAL_PATH.split(":")]
    for candidate in dict.fromkeys(candidates):
        if candidate and os.path.exists(candidate):
            result = _run([candidate, "-I", "-c", "pass"], {}, "", SandboxLimits(timeout_s=20.0))
            if result.ok:
                return candidate
    return None


@cache
def _uid_for(pid: int) -> int | None:
    """UID_BASE + pid % UID_SPAN if a child may switch to it (the pid argument keys the cache, so a
    forked process computes its own)."""
    uid = UID_BASE + pid % UID_SPAN
    try:
        result = subprocess.run(["/bin/true"], user=uid, group=uid, extra_groups=[], env={}, cwd="/",
                                timeout=10, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return uid if result.returncode == 0 else None


@cache
def _probe_network(pid: int) -> bool:
    uid = _uid_for(pid)
    ids = {"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}
    try:
        result = subprocess.run(["/bin/true"], preexec_fn=_Unshare(), env={}, cwd="/", timeout=10,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **ids)
    except (OSError, subprocess.SubprocessError):
        return False
    return result.returncode == 0


class _Unshare:
    """preexec_fn part: unshare(CLONE_NEWUSER | CLONE_NEWNET), raising OSError when refused."""

    def __init__(self) -> None:
        self.libc = _libc()

    def __call__(self) -> None:
        if hasattr(os, "unshare"):  # Python 3.12+
            os.unshare(CLONE_NEWUSER | CLONE_NEWNET)  # type: ignore[attr-defined]
            return
        if self.libc is None or self.libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER | CLONE_NEWNET) failed")


class _ChildSetup:
    """The preexec_fn: limits, no new privileges, death with the parent, and namespaces. Runs in the
    child after subprocess has set the session, groups and uid; built in the parent so the child only
    makes system calls."""

    def __init__(self, limits: SandboxLimits, isolate_network: bool):
        cpu = limits.cpu_s if limits.cpu_s is not None else int(limits.timeout_s) + 1
        self.rlimits = [
            (resource.RLIMIT_CPU, (cpu, cpu + 1)),
            (resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes)),
            (resource.RLIMIT_FSIZE, (limits.file_size_bytes, limits.file_size_bytes)),
            (resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes)),
            (resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files)),
            (resource.RLIMIT_CORE, (0, 0)),
        ]
        self.libc = _libc()
        self.unshare = _Unshare() if isolate_network else None

    def __call__(self) -> None:
        if self.libc is not None:
            self.libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            self.libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        if self.unshare is not None:
            self.unshare()
        for kind, (soft, hard) in self.rlimits:
            current_hard = resource.getrlimit(kind)[1]
            if current_hard != resource.RLIM_INFINITY:
                soft, hard = min(soft, current_hard), min(hard, current_hard)
            resource.setrlimit(kind, (soft, hard))


@cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def _run(argv: list[str], files: dict[str, str], stdin: str, limits: SandboxLimits) -> SandboxResult:
    uid = sandbox_uid()
    isolate_network = network_isolation_available()
    workdir = tempfile.mkdtemp(prefix="rl360-sandbox-")
    try:
        for name, text in files.items():
            with open(os.path.join(workdir, name), "w", encoding="utf-8") as handle:
                handle.write(text)
        ids: dict = {}
        if uid is not None:
            for path in [workdir, *(os.path.join(workdir, name) for name in files)]:
                os.chown(path, uid, uid)
            ids = {"user": uid, "group": uid, "extra_groups": []}
        env = {"PATH": MINIMAL_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8", "PYTHONNOUSERSITE": "1"}
        started = time.monotonic()
        try:
            process = subprocess.Popen(
                argv, cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
                preexec_fn=_ChildSetup(limits, isolate_network), **ids)
        except (OSError, subprocess.SubprocessError) as err:
            return SandboxResult(None, "", "", error=f"sandbox could not start {argv[0]}: {err}",
                                 uid_isolated=uid is not None, network_isolated=isolate_network)
        try:
            out, err, timed_out, truncated = _communicate(process, stdin.encode("utf-8"), limits, started)
        finally:
            _kill_all(process, uid)
        code = process.returncode
        return SandboxResult(
            returncode=code, stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
            timed_out=timed_out, killed_by_signal=_signal_name(code), output_truncated=truncated,
            wall_s=time.monotonic() - started, uid_isolated=uid is not None, network_isolated=isolate_network)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _communicate(process: subprocess.Popen, data: bytes, limits: SandboxLimits,
                 started: float) -> tuple[bytes, bytes, bool, bool]:
    """Feed stdin and read stdout/stderr until both close (or the child exited and a short drain passed),
    the deadline, or an output cap. Returns (stdout, stderr, timed_out, truncated)."""
    deadline = started + limits.timeout_s
    chunks: dict[int, list[bytes]] = {process.stdout.fileno(): [], process.stderr.fileno(): []}
    sizes = dict.fromkeys(chunks, 0)
    timed_out = truncated = False
    exited_at: float | None = None
    with selectors.DefaultSelector() as selector:
        for stream in (process.stdout, process.stderr):
            os.set_blocking(stream.fileno(), False)
            selector.register(stream.fileno(), selectors.EVENT_READ)
        offset = 0
        stdin_fd = process.stdin.fileno()
        if data:
            os.set_blocking(process.stdin.fileno(), False)
            selector.register(process.stdin.fileno(), selectors.EVENT_WRITE)
        else:
            process.stdin.close()
        while selector.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if exited_at is None and process.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > _DRAIN_AFTER_EXIT_S:
                break
            wait_s = min(deadline - now, 0.05 if exited_at is None else _DRAIN_AFTER_EXIT_S)
            for key, _ in selector.select(timeout=max(wait_s, 0.0)):
                fd = key.fd
                if fd == stdin_fd:
                    try:
                        offset += os.write(fd, data[offset:offset + 65536])
                    except (BrokenPipeError, BlockingIOError) as err:
                        if isinstance(err, BlockingIOError):
                            continue
                        offset = len(data)
                    if offset >= len(data):
                        selector.unregister(fd)
                        process.stdin.close()
                    continue
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    selector.unregister(fd)
                    continue
                room = limits.max_output_bytes - sizes[fd]
                chunks[fd].append(chunk[:room])
                sizes[fd] += len(chunk)
                if sizes[fd] > limits.max_output_bytes:
                    truncated = True
            if truncated:
                break
    if not timed_out and not truncated:  # the pipes closed, but the child may still be running
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            timed_out = True
    for stream in (process.stdin, process.stdout, process.stderr):
        try:
            stream.close()
        except OSError:
            pass
    out, err = (b"".join(parts) for parts in chunks.values())
    return out, err, timed_out, truncated


def _kill_all(process: subprocess.Popen, uid: int | None) -> None:
    """SIGKILL the child's process group, reap the child, then (with a sandbox uid of its own) kill every
    process left under that uid: a child that called setsid is out of the group but not out of its uid."""
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the child is unreaped here, so its pgid is still its own
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()
    if uid is not None:
        _kill_uid(uid)


def _kill_uid(uid: int) -> None:
    """kill(-1, SIGKILL) from a process running as `uid`: reaches exactly the processes of that uid.
    Repeated a few times, for children forked while the first round was on its way (it stops early once
    kill finds no process; zombies still count as found, hence the bound)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (child)
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            for _ in range(_KILL_ROUNDS):
                os.kill(-1, signal.SIGKILL)
                time.sleep(0.005)
        except ProcessLookupError:
            os._exit(0)
        except BaseException:
            os._exit(1)
        os._exit(0)
    os.waitpid(pid, 0)


def _signal_name(returncode: int | None) -> str | None:
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"
