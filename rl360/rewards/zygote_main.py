"""The zygote process (`rl360.rewards.zygote`): a warm sandbox interpreter that forks sandboxed children.

Run by a tool worker (root) as `PYTHON -I -B zygote_main.py SANDBOX_PY FD`, with the sandbox's scrubbed
environment: it loads the sandbox module from its file `SANDBOX_PY` (it needs only the standard library, and
this interpreter may not see rl360's own environment), imports what the python tool's driver imports
(`PRELOAD`, and PIL where it imports), writes `"ready"` on the socket `FD` and then serves one request at a
time from it, each a JSON datagram:

- `{"op": "fork", ...}` with two descriptors (the child's stdin and stdout pipe ends): forks a child that
  takes those as fd 0 and fd 1 (and 2), closes every other descriptor, makes a session of its own, takes the
  niceness asked for, moves into its directory and applies the sandbox's own child set-up
  (`sandbox._ChildSetup`, the code a sandboxed `Popen` runs before exec: new network and mount namespaces,
  private tmpfs mounts and /proc, setgroups/setresgid/setresuid to the session's uid, resource limits,
  PR_SET_NO_NEW_PRIVS), replaces its whole environment with the sandbox's, and only then runs the script
  given (the tool's driver) as `__main__`, exiting when it returns. Reply: `{"pid": ...}` right after the
  fork, so that the set-up of several children (whose namespaces the kernel may take a while to make) runs
  side by side; a set-up that fails writes `SETUP_FAILED` and why as the child's one line of output and
  exits with status 127, before anything it was sent is read. `{"error": ...}` when it could not fork.
- `{"op": "stop", "pid": ...}`: kills that child's process group, reaps it and kills every process left
  under its uid; reply `{"status": ...}`, its exit status as `subprocess` gives it (negative: the signal).

Nothing of the zygote is left to a child: it holds no secret (scrubbed environment, no rl360 state), its
descriptors are closed in the child, and the uid switch from root to the session's uid clears every
capability as it would before an exec. A fork reseeds `random` (its at-fork hook); the hash seed is the
zygote's, shared by its children. When the socket closes (its worker exited or died) the zygote kills the
children it still has, sweeps their uids and exits.
"""

from __future__ import annotations

import builtins
import gc
import importlib.util
import json
import os
import signal
import socket
import sys
import traceback
import types

PRELOAD = ("base64", "contextlib", "io", "json", "random", "resource", "time", "traceback")
OPTIONAL = ("PIL.Image",)  # where the sandbox interpreter has it
_SANDBOX_NAME = "rl360_zygote_sandbox"
_PR_SET_DUMPABLE = 4
SETUP_FAILED = "rl360 sandbox: the sandbox set-up failed: "  # a child's only line of output when it did


def load_sandbox(path: str) -> types.ModuleType:
    """The sandbox module loaded from its file, under a name of its own."""
    spec = importlib.util.spec_from_file_location(_SANDBOX_NAME, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_SANDBOX_NAME] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    sandbox = load_sandbox(argv[1])
    channel = socket.socket(fileno=int(argv[2]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in PRELOAD:
        __import__(name)
    for name in OPTIONAL:
        try:
            __import__(name)
        except Exception:
            pass
    gc.collect()
    gc.freeze()  # what is loaded now stays shared with the children (no copy when the collector visits it)
    channel.send(b'"ready"')
    children: dict[int, int | None] = {}  # pid -> uid, until reaped
    try:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(channel, 1 << 22, 2)
            except OSError:
                return 0
            if not data:
                return 0
            request = json.loads(data)
            if request["op"] == "fork":
                reply = _fork(sandbox, request, fds)
                if "pid" in reply:
                    children[reply["pid"]] = request["uid"]
            else:
                uid = children.pop(request["pid"], None)
                reply = {"status": _stop(sandbox, request["pid"], uid)}
            channel.send(json.dumps(reply).encode())
    finally:
        _sweep(sandbox, children)


def _fork(sandbox: types.ModuleType, request: dict, fds: list[int]) -> dict:
    """Fork the child of a fork request; its pid (its set-up goes on in the child meanwhile), or why it could
    not be forked."""
    if len(fds) != 2:
        for fd in fds:
            os.close(fd)
        return {"error": "a fork request needs the child's stdin and stdout"}
    try:
        pid = os.fork()
    except OSError as error:
        for fd in fds:
            os.close(fd)
        return {"error": f"fork: {error}"}
    if pid == 0:  # pragma: no cover (child)
        _child(sandbox, request, fds)
    for fd in fds:
        os.close(fd)
    return {"pid": pid}


def _child(sandbox: types.ModuleType, request: dict, fds: list[int]) -> None:  # pragma: no cover (child)
    """In the forked child: the sandbox set-up, then the script; never returns. A set-up that fails writes
    why as the one line of its output and exits with status 127 before anything else runs."""
    try:
        os.setsid()
        stdin, stdout = fds
        os.dup2(stdin, 0)
        os.dup2(stdout, 1)
        os.dup2(stdout, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if request["niceness"]:
            os.setpriority(os.PRIO_PROCESS, 0, min(os.getpriority(os.PRIO_PROCESS, 0) + request["niceness"], 19))
        os.chdir(request["workdir"])
        limits = sandbox.SandboxLimits(**request["limits"])
        setup = sandbox._ChildSetup(limits, request["uid"], request["network"], request["filesystem"],
                                    request["processes"], request["workdir"], request["files"])
        setup()
        if setup.libc is not None:  # as after an exec by this uid: its own processes may inspect it
            setup.libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
        os.environ.clear()
        os.environ.update(request["env"])
    except BaseException as error:
        try:
            os.write(1, f"{SETUP_FAILED}{type(error).__name__}: {error}\n".encode("utf-8", "replace"))
        finally:
            os._exit(127)
    os._exit(_run_script(request["script"]))


def _run_script(script: str) -> int:  # pragma: no cover (child)
    """Run `script` as the program's `__main__`, in place of the zygote's; its exit status."""
    main_module = types.ModuleType("__main__")
    main_module.__dict__.update(__file__="driver.py", __builtins__=builtins)
    sys.modules["__main__"] = main_module
    sys.modules.pop(_SANDBOX_NAME, None)
    sys.argv = ["driver.py"]
    gc.unfreeze()
    try:
        exec(compile(script, "driver.py", "exec"), main_module.__dict__)
        code = 0
    except SystemExit as error:
        code = error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    return code


def _stop(sandbox: types.ModuleType, pid: int, uid: int | None) -> int | None:
    """SIGKILL the child's process group, reap it, then kill every process left under its uid (as the sandbox's
    `_kill_all`, from this small process: the uid sweep forks it); its exit status."""
    for kill in (os.kill, os.killpg):  # itself (it may not have made its session yet), and its process group
        try:
            kill(pid, signal.SIGKILL)  # unreaped until below, so its pid and pgid are still its own
        except OSError:
            pass
    try:
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
    except OSError:
        code = None
    if uid is not None:
        sandbox._kill_uid(uid)
    return code


def _sweep(sandbox: types.ModuleType, children: dict[int, int | None]) -> None:
    """Stop the children still here, with every process of their uids."""
    for pid, uid in children.items():
        _stop(sandbox, pid, uid)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
