"""Run untrusted Python code in a sandboxed subprocess (for `codegen` rewards).

`run_python(code, stdin)` writes `code` to a fresh temporary directory, runs it there with the
interpreter from `sandbox_python()` and returns a `SandboxResult`. `start_session(argv, files, limits, slot)`
starts a process with the same isolation and limits and leaves it running (the python agent tool's interpreter
per trajectory), as the uid `session_uid(slot)`: `SESSION_UID_BASE + (pid % PID_SPAN) * SESSION_SLOTS + slot`,
a range apart from the one-shot runs' uids, so each live session of every process has a uid of its own; its
caller enforces the timeout, memory cap and output cap while it talks to it, and `stop()` kills it and sweeps
its uid. `rl360.rewards.zygote` forks such sessions from a warm interpreter instead of an exec, with the same
child set-up (`_ChildSetup`), where the uid switch is in effect. Four kinds of isolation, each used where
this machine allows it (`isolation()` says which; see "Isolation required" below):

- **uid**: the child runs as a uid of its own, `UID_BASE + (this process's pid % UID_SPAN)`, with no
  supplementary groups, so one sandbox per process at a time never shares a uid with another: file
  permissions then stop writes outside world-writable places and reads of this user's files, it cannot
  signal or ptrace host processes nor read their `/proc/<pid>/environ`, RLIMIT_NPROC counts only its own
  processes, and after the run every process of that uid is killed (even ones that left the process
  group with setsid). Needs a process that can change uid (root).
- **network**: a new network namespace, which has only a down loopback device: no connection leaves it,
  not even to services on this host.
- **filesystem**: a mount namespace of its own (every mount made private) in which the existing
  directories of `PRIVATE_DIRS` (/tmp, /var/tmp, /dev/shm, /run/lock) and its own directory are fresh
  tmpfs mounts (nosuid, nodev, `tmpfs_bytes` and 4096 inodes each). What it writes there is never seen
  by the host and is freed when its last process is gone.
- **processes**: in that mount namespace a private /proc mounted with `hidepid=invisible`: the code sees
  its own processes only, so no other process's command line, environment or existence (Linux >= 5.8,
  where each proc mount has its own options; older kernels refuse the option and this one is missing).

With the uid switch, the namespaces and mounts are made by the child while it is still root, and then it
drops to the sandbox uid (setgroups, setresgid, setresuid), so after exec it holds no capability anywhere
and cannot undo them. Without it (not root), the network and filesystem isolation come from a new user
namespace (unshare(CLONE_NEWUSER | ...)), where its uid and gid are mapped to themselves, so after exec it
holds no capability there either; a private /proc cannot be had that way. Which of these the kernel
allows is probed once per process (a few milliseconds: one run of /bin/true with all of them, and finer
probes only when that fails).

Always, whatever the isolation:

- **Own directory.** cwd, HOME and TMPDIR are a new temporary directory (mode 0700), deleted afterwards
  (with filesystem isolation the child sees at that path a private tmpfs holding its own copy of the files).
- **Memory in total.** Every `_MEMORY_CHECK_S` (50 ms; less often where one scan of /proc takes over
  2.5 ms, so the checks cost at most about 5% of a core) the parent sums the resident memory of the
  sandbox's processes (every process of its uid; without one, this user's processes in its session);
  past `memory_bytes` they are killed as at the timeout, `memory_exceeded` is set and a last line of
  stderr says why. A page shared by several processes counts in each.
- **Limits** (resource.setrlimit in the child): CPU seconds, address space, file size, processes
  (RLIMIT_NPROC, only meaningful with its own uid), open files, no core files; PR_SET_NO_NEW_PRIVS.
- **Wall-clock timeout**: the child gets its own session and process group; past `timeout_s` the group
  (and, with its own uid, every process of that uid) is SIGKILLed.
- **Scrubbed environment**: a minimal PATH, HOME/TMPDIR in the sandbox, PYTHONDONTWRITEBYTECODE; no
  variable of this process is inherited. The interpreter runs with -I (isolated) and -B.
- **Bounded output**: stdout and stderr are captured up to `max_output_bytes` each; past that the
  child is killed and `output_truncated` is set.

**Isolation required.** `run_python` and `run_command` raise `IsolationError` instead of running code
when any of the four is missing, unless RL360_SANDBOX_REQUIRE_ISOLATION is `0` (the trainer sets it from
`reward.require_isolation`, default true); a reward function that calls them then fails, so the reward
pool scores that row 0 and counts the error. RL360_SANDBOX_ISOLATION narrows what is used: `auto` (the
default: all that the machine allows), `none`, or a comma-separated list of `uid`, `network`,
`filesystem`, `processes`; it exists for tests and for users who turn isolation off knowingly (with
RL360_SANDBOX_REQUIRE_ISOLATION=0). `Isolation.summary()` is the one line a run prints at start.
Reward functions that run untrusted code declare it when they register (`register_reward(...,
runs_code=True)`), so that a trainer can refuse at start (`refuse_untrusted_code`) rather than score every
such row 0.

What does not hold: apart from those tmpfs mounts the filesystem is the host's, so the code can read any
world-readable file and write to any other world-writable place within RLIMIT_FSIZE per file, with no
bound on disk use across many files (without filesystem isolation that includes `PRIVATE_DIRS` and its
own directory). The total memory is polled, not enforced by a cgroup: between two checks it can grow past
`memory_bytes` (each process stays within RLIMIT_AS), tmpfs contents are not counted in it, and without a
uid of its own a process that leaves the session is not counted. There is no seccomp filter and no PID
namespace: its parent's pid is the real one (with a uid of its own it cannot signal it, and with a private
/proc not even see it). If the caller itself is killed mid-run (e.g. by the reward pool's timeout), the
direct child dies with it (PR_SET_PDEATHSIG) but its own children are not swept.

Process creation uses `preexec_fn` (namespaces, mounts, writing the files, the uid switch, resource
limits, prctl); in a multi-threaded parent a child could in principle deadlock before exec, and `Popen`
waits for the exec, so only the caller's own timeout (the reward pool's) ends that wait.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rl360.rewards.registry import Route

UID_BASE = 1 << 30  # sandbox uids: far above any real account, below 2**32 - 1
UID_SPAN = 1 << 23  # > pid_max (2**22 on 64-bit Linux): distinct live processes get distinct uids
PID_SPAN = 1 << 22  # pid_max at most (64-bit Linux)
SESSION_SLOTS = 1 << 9  # live sessions (`start_session`) one process may run, each with its own uid
SESSION_UID_BASE = UID_BASE + UID_SPAN  # session uids: up to 2**30 + 2**23 + 2**31 - 1 < 2**32 - 1
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
PR_SET_NO_NEW_PRIVS = 38
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
MINIMAL_PATH = "/usr/local/bin:/usr/bin:/bin"
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # the standard world-writable directories
FEATURES = ("uid", "network", "filesystem", "processes")  # the kinds of isolation, in the order they are shown
ISOLATION_ENV = "RL360_SANDBOX_ISOLATION"  # auto | none | a comma-separated subset of FEATURES
REQUIRE_ENV = "RL360_SANDBOX_REQUIRE_ISOLATION"  # 1 (default): refuse to run code without all of FEATURES
_TMPFS_INODES = 4096  # files and directories per private tmpfs
_MEMORY_CHECK_S = 0.05  # how often the resident memory of the sandbox's processes is summed
_KILL_ROUNDS = 5  # kill(-1) rounds when sweeping a sandbox uid
_DRAIN_AFTER_EXIT_S = 0.2  # how long output is still read once the child exited (a grandchild may hold the pipes)
_SHOWN = {"uid": "a uid of its own", "network": "no network",
          "filesystem": "private /tmp, /var/tmp, /dev/shm and work directory",
          "processes": "other processes hidden (private /proc)"}
_WHY_MISSING = {
    "uid": "this process cannot switch to another uid (it is not root), so the code could read and write this "
           "user's files and read the environment of this user's processes",
    "network": "the kernel refused a network namespace, so the code can reach the network and this host's services",
    "filesystem": "the kernel refused a mount namespace with private tmpfs mounts",
    "processes": "the kernel refused a private /proc with hidepid=invisible (Linux >= 5.8 needed), so the code "
                 "sees every process and its command line",
}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class IsolationError(RuntimeError):
    """Untrusted code was not run because the isolation it requires is missing (the text says what and how
    to fix it)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. `cpu_s` defaults to the wall-clock timeout rounded up, plus one second."""

    timeout_s: float = 5.0
    cpu_s: int | None = None
    memory_bytes: int = 2 << 30  # RLIMIT_AS of each process, and resident memory of all of them together
    file_size_bytes: int = 64 << 20  # RLIMIT_FSIZE: largest file the code may write
    tmpfs_bytes: int = 64 << 20  # size of each private tmpfs (its directory and each of PRIVATE_DIRS)
    max_processes: int = 16  # RLIMIT_NPROC: processes of the sandbox uid (of this user without one)
    max_open_files: int = 256  # RLIMIT_NOFILE
    max_output_bytes: int = 8 << 20  # per stream (stdout, stderr)


@dataclass
class SandboxResult:
    """How one run ended.

    `returncode` is the exit status (negative: killed by that signal, named in `killed_by_signal`);
    `timed_out` means the wall-clock limit killed it; `output_truncated` that stdout or stderr passed
    the cap and the child was killed; `memory_exceeded` that its processes together held more than
    `memory_bytes` resident and were killed (a line at the end of stderr says so); `error` that it could
    not be started at all (then returncode is None). `uid_isolated` / `network_isolated` /
    `filesystem_isolated` / `processes_isolated` say which isolation applied.
    """

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    killed_by_signal: str | None = None
    output_truncated: bool = False
    memory_exceeded: bool = False
    wall_s: float = 0.0
    uid_isolated: bool = False
    network_isolated: bool = False
    filesystem_isolated: bool = False
    error: str | None = None
    processes_isolated: bool = False

    @property
    def ok(self) -> bool:
        """Exited by itself with status 0, within every limit."""
        return (self.returncode == 0 and not self.timed_out and not self.output_truncated
                and not self.memory_exceeded and self.error is None)


@dataclass(frozen=True)
class Isolation:
    """What isolation untrusted code gets: the `FEATURES` `in_effect`, the `missing` ones each with why,
    whether isolation is `required` (RL360_SANDBOX_REQUIRE_ISOLATION), and `remote_url` when code runs on
    a sandbox server instead (`rl360.rewards.remote_sandbox.code_isolation`; that server isolates it)."""

    in_effect: tuple[str, ...] = ()
    missing: tuple[tuple[str, str], ...] = ()  # (feature, why), in FEATURES order
    required: bool = True
    remote_url: str = ""

    @property
    def complete(self) -> bool:
        """Every kind of isolation applies (or the code runs remotely)."""
        return bool(self.remote_url) or not self.missing

    @property
    def refuses(self) -> bool:
        """Whether untrusted code is refused here: isolation is required and some of it is missing."""
        return self.required and not self.complete

    def summary(self) -> str:
        """One line for the start of a run: what isolation untrusted code gets, and what is missing."""
        if self.remote_url:
            return (f"rl360 sandbox: untrusted code runs on the sandbox server {self.remote_url} "
                    "(RL360_SANDBOX_URL); its isolation is that server's")
        if not self.missing:
            return "rl360 sandbox: untrusted code runs isolated: " + ", ".join(_SHOWN[f] for f in self.in_effect)
        then = ("code is refused (reward.require_isolation=true)" if self.required
                else "code runs anyway (reward.require_isolation=false)")
        return (f"rl360 sandbox: WARNING: untrusted code is not fully isolated; in effect: "
                f"{', '.join(self.in_effect) or 'none'}; missing: {self._missing_text()}; {then}")

    def refusal(self) -> str:
        """Why untrusted code is refused, and the ways out."""
        return (f"refusing to run untrusted code without isolation (missing: {self._missing_text()}); run as root "
                "on Linux with namespaces allowed, point RL360_SANDBOX_URL at a sandbox server (rl360 serve sandbox "
                "on a machine set aside for it), or accept the risk with reward.require_isolation=false "
                f"({REQUIRE_ENV}=0)")

    def _missing_text(self) -> str:
        return "; ".join(f"{feature} ({why})" for feature, why in self.missing)


def run_python(code: str, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a Python script in the sandbox, `stdin` fed to it; see the module docstring.
    `IsolationError` when isolation is required and some is missing."""
    limits = limits or SandboxLimits()
    features = _features_for_untrusted_code()
    python = _interpreter(features)
    if python is None:
        return SandboxResult(None, "", "", error="no Python interpreter can be run inside the sandbox")
    return _run([python, "-I", "-B", "solution.py"], {"solution.py": code}, stdin, limits, features)


def run_command(argv: list[str], files: dict[str, str] | None = None, stdin: str = "",
                limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `argv` in the sandbox with `files` (name -> text) written into its directory first;
    `IsolationError` as `run_python`."""
    return _run(argv, files or {}, stdin, limits or SandboxLimits(), _features_for_untrusted_code())


def isolation(environ: Mapping[str, str] | None = None) -> Isolation:
    """What code run here by `run_python` gets: the probed isolation (cached per process) narrowed by
    RL360_SANDBOX_ISOLATION, and RL360_SANDBOX_REQUIRE_ISOLATION, read from `environ` (default: this
    process's environment). `ValueError` naming a bad value of either variable."""
    environ = os.environ if environ is None else environ
    allowed = allowed_features(environ)
    required = isolation_required(environ)
    can_switch = sandbox_uid() is not None
    switch = can_switch and "uid" in allowed
    if switch == can_switch:  # the usual case: through the probes' public functions
        available = {"network": network_isolation_available(), "filesystem": filesystem_isolation_available(),
                     "processes": process_isolation_available()}
    else:  # root told not to switch uid: namespaces come from a user namespace instead
        unsupported = _unsupported(os.getpid(), False)
        available = {feature: feature not in unsupported for feature in FEATURES[1:]}
    available["uid"] = can_switch
    in_effect: list[str] = []
    missing: list[tuple[str, str]] = []
    for feature in FEATURES:
        if feature not in allowed:
            why = f"turned off by {ISOLATION_ENV}={environ.get(ISOLATION_ENV)!r}"
        elif feature == "processes" and not switch:
            why = "a private /proc needs the switch to a uid of its own"
        elif feature == "processes" and "filesystem" not in in_effect:
            why = "a private /proc needs the private mounts (filesystem isolation)"
        else:
            why = None if available[feature] else _WHY_MISSING[feature]
        if why is None:
            in_effect.append(feature)
        else:
            missing.append((feature, why))
    return Isolation(tuple(in_effect), tuple(missing), required)


def allowed_features(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The isolation RL360_SANDBOX_ISOLATION allows: all of FEATURES for `auto` or unset, none for `none`,
    else the comma-separated names it lists; `ValueError` naming an unknown one."""
    environ = os.environ if environ is None else environ
    raw = environ.get(ISOLATION_ENV, "")
    value = raw.strip().lower()
    if value in ("", "auto"):
        return frozenset(FEATURES)
    if value == "none":
        return frozenset()
    names = {part.strip() for part in value.split(",") if part.strip()}
    unknown = sorted(names - set(FEATURES))
    if unknown:
        raise ValueError(f"{ISOLATION_ENV}={raw!r}: unknown isolation {unknown}; use 'auto', 'none' or a "
                         f"comma-separated list of {list(FEATURES)}")
    return frozenset(names)


def isolation_required(environ: Mapping[str, str] | None = None) -> bool:
    """RL360_SANDBOX_REQUIRE_ISOLATION as a bool (unset: True); `ValueError` naming any other value."""
    environ = os.environ if environ is None else environ
    raw = environ.get(REQUIRE_ENV, "")
    value = raw.strip().lower()
    if value == "" or value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{REQUIRE_ENV}={raw!r}: use one of {list(_TRUE + _FALSE)}")


def isolation_env(require: bool) -> dict[str, str]:
    """The variable that carries `reward.require_isolation` to reward workers (`RewardPool(env=...)`)."""
    return {REQUIRE_ENV: "1" if require else "0"}


def refuse_untrusted_code(routes: Mapping[str, Route], found: Isolation) -> None:
    """`IsolationError` when `found` refuses untrusted code and one of `routes` (data_source -> the reward
    route that scores it, as `rl360.rewards.check.check_reward_data` returns them) runs the response's code
    (registered with `runs_code=True`); the error names those data sources."""
    if not found.refuses:
        return
    untrusted = sorted(source for source, route in routes.items() if route.runs_code)
    if untrusted:
        shown = untrusted[:10] + ([f"... {len(untrusted) - 10} more"] if len(untrusted) > 10 else [])
        raise IsolationError(f"the data holds {shown}, scored by running the response's code: {found.refusal()}")


def sandbox_uid() -> int | None:
    """The uid sandboxes started by this process run as, or None when this process cannot change uid."""
    return _uid_for(os.getpid())


def network_isolation_available() -> bool:
    """Whether a child can enter a network namespace of its own (probed once per process)."""
    return "network" not in _unsupported(os.getpid(), sandbox_uid() is not None)


def filesystem_isolation_available() -> bool:
    """Whether a child can also enter a mount namespace of its own and get its private tmpfs mounts (probed
    once per process, with the network namespace when that is available)."""
    return "filesystem" not in _unsupported(os.getpid(), sandbox_uid() is not None)


def process_isolation_available() -> bool:
    """Whether a child can also get a private /proc that hides other processes (needs the uid switch)."""
    return "processes" not in _unsupported(os.getpid(), sandbox_uid() is not None)


def sandbox_python() -> str | None:
    """The first interpreter that runs inside the sandbox, with the isolation in effect: this one, else
    python3 on the minimal PATH (the sandbox uid may not reach this one, e.g. a virtualenv under /root)."""
    return _interpreter(frozenset(isolation().in_effect))


def _features_for_untrusted_code() -> frozenset[str]:
    """The isolation to run untrusted code with; `IsolationError` when some is missing and it is required."""
    found = isolation()
    if found.refuses:
        raise IsolationError(found.refusal())
    return frozenset(found.in_effect)


@cache
def _interpreter(features: frozenset[str]) -> str | None:
    candidates = [sys.executable] + [os.path.join(d, "python3") for d in MINIMAL_PATH.split(":")]
    for candidate in dict.fromkeys(candidates):
        if candidate and os.path.exists(candidate):
            result = _run([candidate, "-I", "-c", "pass"], {}, "", SandboxLimits(timeout_s=20.0), features)
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
def _unsupported(pid: int, switch_uid: bool) -> frozenset[str]:
    """The namespace isolation (network, filesystem, processes) a child of this process cannot get, with
    (`switch_uid`) or without the uid switch; pid keys the cache as in `_uid_for`. One probe with all of
    them, and one per feature only when that fails."""
    base = {"uid"} if switch_uid else set()
    wanted = ("network", "filesystem", "processes") if switch_uid else ("network", "filesystem")
    if _probe(pid, frozenset(base.union(wanted))):
        works = base.union(wanted)
    else:
        works = set(base)
        for feature in wanted:
            if feature == "processes" and "filesystem" not in works:
                continue
            if _probe(pid, frozenset(works | {feature})):
                works.add(feature)
    return frozenset(FEATURES[1:]) - works


@cache
def _probe(pid: int, features: frozenset[str]) -> bool:
    """Whether /bin/true runs in the sandbox with these features (pid keys the cache, as in `_uid_for`)."""
    return _run(["/bin/true"], {"probe": ""}, "", SandboxLimits(timeout_s=10.0), features).ok


class _ChildSetup:
    """The preexec_fn: death with the parent, no new privileges, the isolation, then the resource limits.
    Runs in the child after subprocess has set the cwd and the session; built in the parent so the child
    only makes system calls and writes its files.

    With `uid` (this process is root): new network and mount namespaces as asked, made as root; in the
    mount namespace every existing directory of `PRIVATE_DIRS` and the sandbox directory become fresh tmpfs
    mounts, `files` are written anew into the directory (owned by `uid`), which becomes the cwd, and with
    `processes` a private /proc (hidepid=invisible) replaces the host's; then the switch to `uid`. Without
    it: the same namespaces inside a new user namespace, with the same mounts and no /proc. Raises
    OSError when the kernel refuses."""

    def __init__(self, limits: SandboxLimits, uid: int | None, network: bool, filesystem: bool, processes: bool,
                 workdir: str, files: dict[str, str]):
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
        self.uid = uid
        self.flags = (CLONE_NEWNET if network else 0) | (CLONE_NEWNS if filesystem else 0)
        self.filesystem, self.processes = filesystem, processes
        self.private_dirs = [d for d in dict.fromkeys(map(os.path.realpath, PRIVATE_DIRS)) if os.path.isdir(d)]
        self.workdir, self.files = workdir, files
        self.tmpfs_options = f"size={limits.tmpfs_bytes},nr_inodes={_TMPFS_INODES}"

    def __call__(self) -> None:
        if self.libc is not None:
            self.libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            self.libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        elif self.flags:
            raise OSError(errno.ENOSYS, "no C library to call unshare with")
        if self.uid is not None:
            self._isolate_as_root()
        elif self.flags:
            self._isolate_in_user_namespace()
        for kind, (soft, hard) in self.rlimits:
            current_hard = resource.getrlimit(kind)[1]
            if current_hard != resource.RLIM_INFINITY:
                soft, hard = min(soft, current_hard), min(hard, current_hard)
            resource.setrlimit(kind, (soft, hard))

    def _isolate_as_root(self) -> None:
        uid = self.uid
        if self.flags:
            self._check(self.libc.unshare(self.flags), "unshare")
        if self.filesystem:
            self._private_mounts(owner=uid)
        if self.processes:
            self._check(self.libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                                        b"hidepid=invisible"), "mount a private /proc")
        for fd in (0, 1, 2):  # its pipes: so that it may open /dev/stdin (/proc/self/fd/0) as the sandbox uid
            os.fchown(fd, uid, uid)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)

    def _isolate_in_user_namespace(self) -> None:
        uid, gid = os.getuid(), os.getgid()
        if self.filesystem:  # a non-dumpable process (the reward worker is one) cannot write its uid_map
            self.libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        self._check(self.libc.unshare(CLONE_NEWUSER | self.flags), "unshare")
        if not self.filesystem:
            return
        # Map the uid and gid to themselves: files on the new tmpfs need an owner mapped in this namespace
        # (EOVERFLOW otherwise), and a uid other than 0 inside keeps no capability after exec.
        for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as handle:
                handle.write(text)
        self._private_mounts(owner=None)

    def _private_mounts(self, owner: int | None) -> None:
        """Every mount private, tmpfs on the private directories and on the work directory (owned by `owner`,
        else by this process), the files written there, and the cwd moved onto it."""
        self._check(self.libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
        for path in self.private_dirs:
            self._mount_tmpfs(path, "mode=1777")
        os.makedirs(self.workdir, exist_ok=True)  # under a private directory it has to be made again
        self._mount_tmpfs(self.workdir, "mode=0700" + (f",uid={owner},gid={owner}" if owner is not None else ""))
        for name, text in self.files.items():
            path = os.path.join(self.workdir, name)
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text)
            if owner is not None:
                os.chown(path, owner, owner)
        os.chdir(self.workdir)

    def _mount_tmpfs(self, path: str, extra: str) -> None:
        options = f"{self.tmpfs_options},{extra}".encode()
        self._check(self.libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options),
                    f"mount tmpfs on {path}")

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"{what}: {os.strerror(code)}")


@cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def _run(argv: list[str], files: dict[str, str], stdin: str, limits: SandboxLimits,
         features: frozenset[str]) -> SandboxResult:
    """Run `argv` in a new sandbox directory holding `files`, with the isolation `features` (a subset of
    FEATURES that this process can give)."""
    uid = sandbox_uid() if "uid" in features else None
    started = time.monotonic()
    try:
        child = _start(argv, files, limits, features, uid, merge_stderr=False)
    except (OSError, subprocess.SubprocessError) as err:
        return SandboxResult(None, "", "", error=f"sandbox could not start {argv[0]}: {err}",
                             **_isolated(features, uid))
    process = child.process
    try:
        try:
            out, err, stopped = _communicate(process, stdin.encode("utf-8"), limits, started, uid)
        finally:
            _kill_all(process, uid)
        if stopped == "memory":
            err += (f"\nrl360 sandbox: killed: its processes held more than {limits.memory_bytes >> 20} MiB "
                    "of resident memory in total\n").encode()
        code = process.returncode
        return SandboxResult(
            returncode=code, stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
            timed_out=stopped == "timeout", killed_by_signal=_signal_name(code), output_truncated=stopped == "output",
            memory_exceeded=stopped == "memory", wall_s=time.monotonic() - started, **child.isolated)
    finally:
        shutil.rmtree(child.workdir, ignore_errors=True)


@dataclass
class SandboxProcess:
    """A sandboxed process left running (`start_session`): its `Popen` (stdin and stdout pipes, stderr merged
    into stdout), its uid (None without one), its directory and the isolation it got. `stop()` kills it and
    every process of its uid, and deletes its directory."""

    process: subprocess.Popen
    uid: int | None
    workdir: str
    isolated: dict[str, bool]

    def stop(self) -> None:
        try:
            _kill_all(self.process, self.uid)
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)


def start_session(argv: list[str], files: dict[str, str], limits: SandboxLimits, slot: int) -> SandboxProcess:
    """Start `argv` in a new sandbox directory holding `files` and leave it running, as uid `session_uid(slot)`
    (a uid of its own per live session of this process, where the uid switch is in effect), with the same
    isolation and limits as `run_command` (the wall-clock timeout, memory polling and output cap are the
    caller's to enforce while it talks to the process over its pipes). `IsolationError` as `run_python`,
    OSError when it cannot start."""
    features = _features_for_untrusted_code()
    uid = session_uid(slot) if "uid" in features else None
    return _start(argv, files, limits, features, uid, merge_stderr=True)


def session_uid(slot: int) -> int | None:
    """The uid of the session in `slot` (0 <= slot < SESSION_SLOTS) of this process, None when this process
    cannot change uid: `SESSION_UID_BASE + (pid % PID_SPAN) * SESSION_SLOTS + slot`, a range apart from
    `sandbox_uid()`'s, so sessions of all live processes, and their one-shot runs, never share a uid."""
    if not 0 <= slot < SESSION_SLOTS:
        raise ValueError(f"session slot {slot} outside [0, {SESSION_SLOTS})")
    if sandbox_uid() is None:
        return None
    return SESSION_UID_BASE + (os.getpid() % PID_SPAN) * SESSION_SLOTS + slot


def resident_bytes(uid: int | None, session: int) -> int:
    """Resident memory of a sandbox's processes: every process of `uid`, or without one, this user's processes
    in the session `session` (the sandboxed process's pid)."""
    return _resident_bytes(uid, session)


def _isolated(features: frozenset[str], uid: int | None) -> dict[str, bool]:
    filesystem = "filesystem" in features
    return {"uid_isolated": uid is not None, "network_isolated": "network" in features,
            "filesystem_isolated": filesystem,
            "processes_isolated": "processes" in features and uid is not None and filesystem}


def _start(argv: list[str], files: dict[str, str], limits: SandboxLimits, features: frozenset[str],
           uid: int | None, merge_stderr: bool) -> SandboxProcess:
    """Make the sandbox directory holding `files` and start `argv` there (pipes on stdin, stdout and stderr,
    or stderr into stdout); OSError or SubprocessError (its directory deleted) when it cannot start."""
    isolated = _isolated(features, uid)
    workdir = make_workdir(files, uid)
    try:
        env = sandbox_env(workdir)
        setup = _ChildSetup(limits, uid, isolated["network_isolated"], isolated["filesystem_isolated"],
                            isolated["processes_isolated"], workdir, files)
        process = subprocess.Popen(
            argv, cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, start_new_session=True, close_fds=True,
            preexec_fn=setup)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return SandboxProcess(process, uid, workdir, isolated)


def make_workdir(files: dict[str, str], uid: int | None) -> str:
    """A new sandbox directory (mode 0700) holding `files`, owned with them by `uid` when there is one."""
    workdir = tempfile.mkdtemp(prefix="rl360-sandbox-")
    try:
        for name, text in files.items():
            with open(os.path.join(workdir, name), "w", encoding="utf-8") as handle:
                handle.write(text)
        if uid is not None:
            for path in [workdir, *(os.path.join(workdir, name) for name in files)]:
                os.chown(path, uid, uid)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return workdir


def sandbox_env(workdir: str) -> dict[str, str]:
    """The whole environment of sandboxed code whose directory is `workdir` (nothing of this process's)."""
    return {"PATH": MINIMAL_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8", "PYTHONNOUSERSITE": "1"}


def _communicate(process: subprocess.Popen, data: bytes, limits: SandboxLimits, started: float,
                 uid: int | None) -> tuple[bytes, bytes, str | None]:
    """Feed stdin and read stdout/stderr until the child exited and both closed (or a short drain passed),
    or a limit stops it: the deadline, an output cap, or resident memory summed over its processes
    (checked every `_MEMORY_CHECK_S`). Returns (stdout, stderr, None or "timeout" / "output" / "memory")."""
    deadline = started + limits.timeout_s
    chunks: dict[int, list[bytes]] = {process.stdout.fileno(): [], process.stderr.fileno(): []}
    sizes = dict.fromkeys(chunks, 0)
    stopped: str | None = None
    exited_at: float | None = None
    next_memory_check = started
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
        while stopped is None:
            now = time.monotonic()
            if now >= deadline:
                stopped = "timeout"
                break
            if now >= next_memory_check:
                if _resident_bytes(uid, process.pid) > limits.memory_bytes:
                    stopped = "memory"
                    break
                # where scanning /proc is slow (many processes), less often: at most ~5% of this core
                next_memory_check = now + max(_MEMORY_CHECK_S, 20 * (time.monotonic() - now))
            if exited_at is None and process.poll() is not None:
                exited_at = now
            if exited_at is not None and (not selector.get_map() or now - exited_at > _DRAIN_AFTER_EXIT_S):
                break
            wait_s = min(deadline - now, _MEMORY_CHECK_S if exited_at is None else _DRAIN_AFTER_EXIT_S)
            for key, _ in selector.select(timeout=max(wait_s, 0.0)):  # with no pipe left open: a sleep
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
                    stopped = "output"
    for stream in (process.stdin, process.stdout, process.stderr):
        try:
            stream.close()
        except OSError:
            pass
    out, err = (b"".join(parts) for parts in chunks.values())
    return out, err, stopped


def _resident_bytes(uid: int | None, session: int) -> int:
    """Resident memory summed over the sandbox's processes (a page shared by several counts in each): every
    process of its uid, or, without one, every process of this user in its session. /proc/<pid> is owned by
    the process's effective uid even when it made itself non-dumpable, and that uid cannot change."""
    owner = os.geteuid() if uid is None else uid
    total = 0
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                if entry.stat().st_uid != owner or (uid is None and os.getsid(int(entry.name)) != session):
                    continue
                with open(f"/proc/{entry.name}/statm", "rb") as handle:
                    total += int(handle.read().split()[1]) * resource.getpagesize()
            except (OSError, ValueError, IndexError):  # it exited meanwhile
                continue
    return total


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
