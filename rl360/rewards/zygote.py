"""Sandboxed sessions forked from a warm interpreter: the python tool's fast interpreter start.

Starting a sandboxed interpreter with `start_session` costs a fork of the caller, the sandbox set-up and an
exec of Python, whose start-up and imports are most of the time. A `Zygote` is one process per tool worker,
started once with the sandbox interpreter (`python -I -B rl360/rewards/zygote_main.py`), that has already
imported what the driver needs; `Zygote.start` asks it to fork a child, which applies the same set-up code
as the exec path (`sandbox._ChildSetup`: uid `session_uid(slot)`, new network namespace, private mount
namespace with tmpfs /tmp, /var/tmp, /dev/shm, /run/lock and its own directory, a private /proc with
hidepid=invisible, rlimits, PR_SET_NO_NEW_PRIVS, setgroups/setresgid/setresuid, so it holds no capability
afterwards), takes the sandbox's scrubbed environment and only then runs the script. What the caller gets is
a `SandboxProcess` like `start_session`'s (`ForkedSession`): its pipes, uid and directory, and `stop()` has the
zygote, its parent, kill its process group and every process of its uid and reap it, then deletes its
directory.

The fork path is used only where the uid switch is in effect (`available`, i.e. root with the sandbox's
isolation): without it a child of the zygote would share the zygote's uid, so there `start_session` starts
each interpreter as before an exec would. The zygote itself runs only this package's code, as root in the
host's namespaces, and never a cell; see `zygote_main` for what a child inherits from it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

from rl360.rewards import sandbox
from rl360.rewards.sandbox import SandboxLimits, SandboxProcess

_MAIN = Path(__file__).with_name("zygote_main.py")
_START_TIMEOUT_S = 60.0  # the zygote's own start-up (Python and its imports), on a loaded machine
_MAX_REPLY = 1 << 16


class ZygoteError(OSError):
    """The zygote could not be started or stopped answering (not a refusal of the sandbox set-up)."""


def available() -> bool:
    """Whether sandboxed sessions may be forked from a zygote here: the isolation required for untrusted code
    is in place (`IsolationError` otherwise, as `start_session`) and includes a uid of its own per session."""
    return "uid" in sandbox._features_for_untrusted_code()


class _ForkedProcess:
    """What the python tool's worker uses of a `Popen`, for a child of the zygote: pid, returncode and our ends
    of its stdin and stdout."""

    def __init__(self, pid: int, stdin: int, stdout: int):
        self.pid, self.returncode = pid, None
        self.stdin, self.stdout = os.fdopen(stdin, "wb", buffering=0), os.fdopen(stdout, "rb", buffering=0)


@dataclasses.dataclass
class ForkedSession(SandboxProcess):
    """A `SandboxProcess` forked by `zygote`: `stop()` has the zygote kill its process group, reap it and
    sweep its uid (else, with the zygote gone, kills them from here), then deletes its directory."""

    zygote: Zygote | None = None

    def stop(self) -> None:
        try:
            if self.process.returncode is None:
                self.process.returncode = self.zygote.stop(self.process.pid, self.uid)
        finally:
            for stream in (self.process.stdin, self.process.stdout):
                stream.close()
            shutil.rmtree(self.workdir, ignore_errors=True)


class Zygote:
    """One zygote process running `python` (the sandbox interpreter), started here; one request at a time."""

    def __init__(self, python: str):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [python, "-I", "-B", str(_MAIN), sandbox.__file__, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                env=sandbox.sandbox_env("/"), cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                start_new_session=True)
        finally:
            theirs.close()
        self.channel = ours
        self.channel.settimeout(_START_TIMEOUT_S)
        try:
            ready = self.channel.recv(_MAX_REPLY)
        except OSError as error:
            ready = str(error).encode()
        self.channel.settimeout(None)
        if ready != b'"ready"':
            self.close()
            raise ZygoteError(f"the sandbox zygote ({python}) did not start: {ready[:200]!r}")

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def start(self, script: str, files: dict[str, str], limits: SandboxLimits, slot: int,
              niceness: int = 0) -> SandboxProcess:
        """A new sandboxed child running `script` as `__main__`, in a new sandbox directory holding `files`, as
        uid `session_uid(slot)`, with the isolation and limits `start_session` gives (its stdout and stderr are
        one pipe), at `niceness` above the zygote's. `IsolationError` as `start_session`, OSError when it could
        not fork, `ZygoteError` when the zygote is gone. Its set-up is still under way when this returns: one
        that fails writes `zygote_main.SETUP_FAILED` and why as its only output and exits with status 127."""
        features = sandbox._features_for_untrusted_code()
        uid = sandbox.session_uid(slot) if "uid" in features else None
        if uid is None:
            raise ZygoteError("a forked session needs a uid of its own (root)")
        isolated = sandbox._isolated(features, uid)
        workdir = sandbox.make_workdir(files, uid)
        pipes = [os.pipe2(os.O_CLOEXEC), os.pipe2(os.O_CLOEXEC)]  # (read, write) of its stdin, then its stdout
        ours = [pipes[0][1], pipes[1][0]]
        try:
            request = {"op": "fork", "script": script, "files": files, "workdir": workdir, "uid": uid,
                       "limits": dataclasses.asdict(limits), "env": sandbox.sandbox_env(workdir),
                       "niceness": niceness, "network": isolated["network_isolated"],
                       "filesystem": isolated["filesystem_isolated"], "processes": isolated["processes_isolated"]}
            try:
                reply = self._ask(request, [pipes[0][0], pipes[1][1]])
            finally:
                os.close(pipes[0][0])
                os.close(pipes[1][1])
            if "error" in reply:
                raise OSError(f"the sandbox zygote could not fork: {reply['error']}")
        except BaseException:
            for fd in ours:
                os.close(fd)
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return ForkedSession(_ForkedProcess(reply["pid"], *ours), uid, workdir, isolated, zygote=self)

    def stop(self, pid: int, uid: int) -> int | None:
        """Kill the child `pid` with every process of its uid and reap it; its exit status (None when the zygote
        is gone: then its process group and uid are killed from here, and init reaps it)."""
        try:
            return self._ask({"op": "stop", "pid": pid}, [])["status"]
        except ZygoteError:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
            sandbox._kill_uid(uid)
            return None

    def close(self) -> None:
        """Close the socket: the zygote kills the children it still has, sweeps their uids and exits."""
        self.channel.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _ask(self, request: dict, fds: list[int]) -> dict:
        try:
            socket.send_fds(self.channel, [json.dumps(request).encode()], fds)
            reply = self.channel.recv(_MAX_REPLY)
        except OSError as error:
            raise ZygoteError(f"the sandbox zygote is gone: {error}") from error
        if not reply:
            raise ZygoteError("the sandbox zygote is gone")
        return json.loads(reply)
