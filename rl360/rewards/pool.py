"""Score many responses in worker processes, each call under a wall-clock timeout.

`RewardPool.score(items)` keeps `num_workers` calls in flight and returns one `RewardResult` per item,
in input order. A call past `timeout_s` scores 0 with `timed_out=True`, and its worker is killed (with
any processes it started) and replaced, so a reward function that never returns costs one timeout and
never blocks the pool. An exception in the reward function scores 0 with its text in `error`; a worker
that dies (os._exit, a segfault, the kernel's OOM killer) scores 0 with an error and is replaced.

Start method: "forkserver". Plain "fork" copies the parent's threads' locks in whatever state they are
in; the trainer process, a Ray actor (gRPC and Ray's own threads) and torch all run threads, so a
forked child can deadlock. "forkserver" forks each worker from one small single-threaded server that
has already imported `rl360.rewards` (math-verify and sympy, about a second), so it is as safe as
"spawn" and a killed worker is replaced in a fraction of a second instead of a fresh interpreter's start-up.
The rewards' first-use caches are built before a worker takes calls (`rl360.rewards.warm_up`, in the
forkserver, or in the worker where another forkserver was started first), and a call's timeout starts when its
worker has said it is ready, so neither a worker's start-up nor a lazily built parser counts against a reward
on a busy node. A worker not ready within WORKER_START_TIMEOUT_S is replaced and its call scores 0 with an
error.
Workers receive the parent's `sys.path` and import reward functions by "module:qualname", which works
the same from a CLI process, a pytest session or a Ray actor. "spawn" is the fallback where the
platform has no forkserver.

Environment: a worker gets only the variables on an allow-list, not this process's whole environment
(API keys of wandb, cloud providers or the judge stay out of reach of reward code and of anything it
runs). `worker_environment` builds it, from this process's environment as it is when the pool is made:

- system and locale: PATH, HOME, USER, LOGNAME, SHELL, TERM, TZ, LANG, LANGUAGE and every LC_*;
  TMPDIR, TMP, TEMP;
- Python and native libraries: PYTHONPATH, PYTHONHOME, PYTHONHASHSEED, PYTHONIOENCODING, PYTHONUTF8,
  PYTHONWARNINGS, PYTHONDONTWRITEBYTECODE, PYTHONUNBUFFERED, PYTHONFAULTHANDLER, VIRTUAL_ENV, CONDA_PREFIX,
  CONDA_DEFAULT_ENV, LD_LIBRARY_PATH, the thread counts (OMP_, MKL_, OPENBLAS_, NUMEXPR_NUM_THREADS),
  CUDA_VISIBLE_DEVICES, CUDA_HOME, TORCH_HOME, HF_HOME, HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE,
  TOKENIZERS_PARALLELISM, XDG_CACHE_HOME;
- TLS and proxies, for the LLM judge's HTTPS requests: SSL_CERT_FILE, SSL_CERT_DIR, REQUESTS_CA_BUNDLE,
  CURL_CA_BUNDLE, HTTP_PROXY, HTTPS_PROXY, NO_PROXY, ALL_PROXY (and their lower-case forms);
- rl360's own settings: RL360_SANDBOX_URL, RL360_SANDBOX_ISOLATION, RL360_SANDBOX_REQUIRE_ISOLATION and
  the judge's RL360_JUDGE_* settings (`rl360.rewards.judge.ENV`; RL360_JUDGE_API_KEY is not one of them) and
  the Lewis listener's RL360_LISTENER_* settings (`rl360.rewards.lewis.ENV`; its key is not one of them);
- the names in `env_passthrough` (`reward.env_passthrough`), for a custom reward that needs more;
- then `env`, which wins over all of the above (the trainer passes the judge's settings from
  `reward.judge` and `reward.require_isolation` there);
- and, only when the result configures a judge endpoint (RL360_JUDGE_URL), the one variable holding the
  judge's API key, as `JudgeClient` looks it up (`rl360.rewards.judge.judge_key_env`); only when it names
  a sandbox server (RL360_SANDBOX_URL), that server's key, RL360_SANDBOX_API_KEY; only when it names a
  listener service (RL360_LISTENER_URL), the variable holding its key (RL360_LISTENER_API_KEY_ENV names it,
  default RL360_LISTENER_API_KEY).

Workers fork from a long-lived forkserver whose own environment is that of the process that started it
(the first pool), so each worker replaces its environment with this one when it starts. That replaces
`os.environ` and what subprocesses inherit; the start-up block of the forkserver's environment is still
in the worker's memory and in its /proc/<pid>/environ, so workers also make themselves non-dumpable
(PR_SET_DUMPABLE 0): other processes of the same user, such as code that a sandbox without a uid of its
own runs (`rl360.rewards.sandbox`), can then neither read that file or the worker's memory nor ptrace it.
`num_workers=0` scores in this process, with this process's environment plus `env`.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from rl360.core.trajectory import TrajectorySummary
from rl360.data.schema import extra_info_dict
from rl360.imports import import_ref
from rl360.rewards.registry import call_reward, reward_ref

if TYPE_CHECKING:
    from rl360.rewards.registry import Route
    from rl360.rewards.sandbox import Isolation

_START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
ALLOWED_ENV = frozenset((
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "TZ", "LANG", "LANGUAGE", "TMPDIR", "TMP", "TEMP",
    "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONIOENCODING", "PYTHONUTF8", "PYTHONWARNINGS",
    "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "VIRTUAL_ENV", "CONDA_PREFIX",
    "CONDA_DEFAULT_ENV", "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "TORCH_HOME", "HF_HOME", "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM", "XDG_CACHE_HOME",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "no_proxy", "all_proxy",
    "RL360_SANDBOX_URL", "RL360_SANDBOX_ISOLATION", "RL360_SANDBOX_REQUIRE_ISOLATION",
))
ALLOWED_ENV_PREFIXES = ("LC_",)
_PR_SET_DUMPABLE = 4
_CODE_ISOLATION = "rl360.rewards.remote_sandbox:code_isolation"
_READY = "ready"  # a worker's first message: set up, waiting for calls
WORKER_START_TIMEOUT_S = 120.0  # a worker not ready by then (a node out of memory or processes) is an error


@dataclass
class RewardItem:
    """One response to score: routed by `data_source`, compared with `ground_truth`. `trajectory` (a multi-turn
    sample's turns' texts and tool calls) reaches the reward function as `extra_info["trajectory"]`, a dict
    (`TrajectorySummary.as_dict`)."""

    data_source: str
    solution_str: str
    ground_truth: str
    extra_info: dict | None = None
    trajectory: TrajectorySummary | None = None

    def reward_extra_info(self) -> dict | None:
        """The `extra_info` the reward function is called with: the row's, plus "trajectory" when there is one."""
        if self.trajectory is None:
            return self.extra_info
        info = extra_info_dict(self.extra_info)
        return {**(info if isinstance(info, dict) else {}), "trajectory": self.trajectory.as_dict()}


@dataclass
class RewardResult:
    """A score (0.0 on any failure); `timed_out` or `error` say why it failed; `extras` are the reward
    function's other dict entries."""

    score: float
    timed_out: bool = False
    error: str | None = None
    extras: dict = field(default_factory=dict)


def domain_of(data_source: str) -> str:
    """The part of a data_source before "__" (`math__deepscaler` -> `math`)."""
    return data_source.split("__", 1)[0]


def score_one(ref: str, item: RewardItem) -> RewardResult:
    """Run one reward call in this process; an exception becomes a 0 score with its text."""
    try:
        value = call_reward(ref, item.data_source, item.solution_str, item.ground_truth, item.reward_extra_info())
        if isinstance(value, dict):
            if "score" not in value:
                return RewardResult(0.0, error=f"reward function {ref} returned a dict without a 'score' key")
            return RewardResult(float(value["score"]), extras={k: v for k, v in value.items() if k != "score"})
        return RewardResult(float(value))
    except Exception as err:  # the reward function's failure (MemoryError included): kept and counted
        return RewardResult(0.0, error=error_text(err))


def error_text(err: BaseException) -> str:
    """`ValueError: message`, or the bare type name when the message is empty."""
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


class RewardPool:
    """`num_workers` worker processes scoring `RewardItem`s, each call under `timeout_s` seconds.

    `max_memory_bytes` caps each worker's address space (RLIMIT_AS); an allocation past it raises
    MemoryError in the reward function, which scores 0 with that error. `num_workers=0` scores in this
    process, one item after another and without a timeout (for debugging). Use a pool from one thread
    at a time.

    Workers run with the allow-listed part of this process's environment as it is when the pool is made,
    the variables named in `env_passthrough`, and `env` (e.g. the LLM judge's settings): see the module
    docstring and `worker_environment`. `ValueError` for a name in `env_passthrough` that cannot be a
    variable name.
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0, max_memory_bytes: int | None = None,
                 env: dict[str, str] | None = None, env_passthrough: Iterable[str] = ()):
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_memory_bytes is not None and max_memory_bytes <= 0:
            raise ValueError(f"max_memory_bytes must be > 0 or None, got {max_memory_bytes}")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.max_memory_bytes = max_memory_bytes
        self._extra_env = dict(env or {})
        self._environ = worker_environment(os.environ, self._extra_env, env_passthrough)
        self._context = _context()
        self._workers = [self._new_worker() for _ in range(num_workers)]
        self._closed = False
        self._last: dict[str, float] = {}
        self._totals: dict[str, float] = {}

    def score(self, items: list[RewardItem]) -> list[RewardResult]:
        """One result per item, in input order. `KeyError` (before any call) for an unknown data_source."""
        if self._closed:
            raise RuntimeError("RewardPool.score called after close()")
        refs = [reward_ref(item.data_source, item.extra_info) for item in items]
        if self.num_workers == 0:
            with _extra_environment(self._extra_env):
                results = [score_one(ref, item) for ref, item in zip(refs, items)]
        else:
            try:
                results = self._score_in_workers(refs, items)
            except BaseException:  # e.g. KeyboardInterrupt: no worker may keep a stale call in flight
                for index, worker in enumerate(self._workers):
                    if worker.task is not None:
                        self._replace(index)
                raise
        self._count(items, results)
        return results

    def _new_worker(self) -> _Worker:
        return _Worker(self._context, self.max_memory_bytes, self._environ)

    def run_in_worker(self, ref: str, timeout_s: float = 60.0) -> Any:
        """The value of the function at "module:qualname" `ref`, called with no arguments in a worker, with
        the worker's environment (in this process with `env` set, for `num_workers=0`): what reward code
        sees there. `RuntimeError` with the worker's error, `TimeoutError` past `timeout_s` (the worker is
        then replaced). Not while a `score` call is under way (a pool is used from one thread at a time)."""
        if self._closed:
            raise RuntimeError("RewardPool.run_in_worker called after close()")
        if self.num_workers == 0:
            with _extra_environment(self._extra_env):
                status, value = _call(ref)
        else:
            status, value = self._call_in_worker(ref, timeout_s)
        if status != "ok":
            raise RuntimeError(f"{ref} failed in a reward worker: {value}")
        return value

    def sandbox_isolation(self) -> Isolation:
        """What isolation code run by reward functions gets in this pool's workers: a
        `rl360.rewards.sandbox.Isolation` (probed there, with their environment; `summary()` is one line)."""
        return self.run_in_worker(_CODE_ISOLATION)

    def last_metrics(self) -> dict[str, float]:
        """Counts of the last `score` call: `reward/calls`, `reward/timeouts`, `reward/errors` (errors
        exclude timeouts), and the same per domain, e.g. `reward/timeouts/math`."""
        return dict(self._last)

    def total_metrics(self) -> dict[str, float]:
        """The same counts summed over every `score` call so far."""
        return dict(self._totals)

    @property
    def totals(self) -> dict[str, float]:
        """Alias of `total_metrics()`."""
        return self.total_metrics()

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            worker.ask_to_exit()
        for worker in self._workers:  # then make sure each one, and anything it started, is gone
            worker.kill(grace_s=1.0)
        self._workers = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _score_in_workers(self, refs: list[str], items: list[RewardItem]) -> list[RewardResult]:
        results: list[RewardResult | None] = [None] * len(items)
        pending = deque(range(len(items)))
        while pending or any(worker.task is not None for worker in self._workers):
            for index in range(len(self._workers)):
                if pending and self._workers[index].task is None:
                    task = pending.popleft()
                    failure = self._dispatch(index, task, (refs[task], items[task]))
                    if failure is not None:
                        results[task] = failure
            self._collect(results)
        return results  # type: ignore[return-value]  (every slot is filled once the loop ends)

    def _dispatch(self, index: int, task: int, message: tuple[str, RewardItem]) -> RewardResult | None:
        """Send one call to an idle worker; a result only when it could not be sent."""
        if self._workers[index].exited():  # died while idle: replace it before use
            self._replace(index)
        worker = self._workers[index]
        try:
            worker.conn.send(message)  # a worker still starting reads it once it is ready
        except OSError as err:
            self._replace(index)
            return RewardResult(0.0, error=f"reward worker died before the call: {err}")
        except Exception as err:  # the item cannot be pickled; nothing was written, the worker stays idle
            return RewardResult(0.0, error=f"reward item could not be sent to a worker: {error_text(err)}")
        worker.task = task
        worker.started = time.monotonic() if worker.ready else None
        return None

    def _collect(self, results: list[RewardResult | None]) -> None:
        """Wait for a result, a ready message, a dead worker or the earliest deadline (a call's `timeout_s` from
        its worker's ready message; a worker's start-up limit), and settle every worker concerned."""
        busy = [worker for worker in self._workers if worker.task is not None]
        if not busy:
            return
        deadline = min(worker.deadline(self.timeout_s) for worker in busy)
        handles = [worker.conn for worker in busy] + [worker.process.sentinel for worker in busy]
        ready = set(wait(handles, timeout=max(0.0, deadline - time.monotonic())))
        now = time.monotonic()
        for index, worker in enumerate(self._workers):
            task = worker.task
            if task is None:
                continue
            if not worker.ready and (worker.conn in ready or worker.process.sentinel in ready):
                if worker.read_ready():  # its call's clock starts now; the result comes later
                    worker.started = now
                else:
                    results[task] = RewardResult(0.0, error=self._not_started(index))
            elif worker.conn in ready or worker.process.sentinel in ready:
                results[task] = self._receive(index)
            elif now >= worker.deadline(self.timeout_s):
                if worker.ready:
                    results[task] = RewardResult(0.0, timed_out=True)
                    self._replace(index)
                else:
                    results[task] = RewardResult(0.0, error=self._not_started(index))

    def _receive(self, index: int) -> RewardResult:
        """The result a worker sent, or an error if it died mid-call (then it is replaced)."""
        worker = self._workers[index]
        try:
            if not worker.conn.poll():  # only the process sentinel fired; a child of it may hold the pipe
                raise EOFError
            result = worker.conn.recv()
        except (EOFError, OSError):  # nothing (or half a message) came: the worker died
            ended = self._replace(index, grace_s=1.0)
            return RewardResult(0.0, error=f"reward worker died during the call ({ended})")
        except Exception as err:  # the whole message was read but cannot be unpickled here
            result = RewardResult(0.0, error=f"reward result could not be read: {error_text(err)}")
        worker.task = None
        return result

    def _call_in_worker(self, ref: str, timeout_s: float) -> tuple[str, Any]:
        if self._workers[0].exited():
            self._replace(0)
        worker = self._workers[0]
        if not worker.wait_ready():
            raise RuntimeError(f"{ref} could not be called: {self._not_started(0)}")
        worker.conn.send(_Call(ref))
        if not wait([worker.conn, worker.process.sentinel], timeout=timeout_s):
            self._replace(0)
            raise TimeoutError(f"{ref} did not return within {timeout_s} s in a reward worker")
        try:
            if not worker.conn.poll():
                raise EOFError
            return worker.conn.recv()
        except (EOFError, OSError):
            ended = self._replace(0, grace_s=1.0)
            raise RuntimeError(f"reward worker died while calling {ref} ({ended})") from None

    def _not_started(self, index: int) -> str:
        """Replace worker `index`, which never said it was ready, and say so."""
        ended = self._replace(index)
        return f"a reward worker ended or hung before it was ready to take calls ({ended}; it has " \
               f"{WORKER_START_TIMEOUT_S:.0f} s to start)"

    def _replace(self, index: int, grace_s: float = 0.0) -> str:
        """Kill worker `index` (after `grace_s` to exit by itself) and start a new one; how the old one ended."""
        ended = self._workers[index].kill(grace_s)
        self._workers[index] = self._new_worker()
        return ended

    def _count(self, items: list[RewardItem], results: list[RewardResult]) -> None:
        last: dict[str, float] = {"reward/calls": 0, "reward/timeouts": 0, "reward/errors": 0}
        for item, result in zip(items, results):
            domain = domain_of(item.data_source)
            for kind in ("calls", "timeouts", "errors"):
                last.setdefault(f"reward/{kind}/{domain}", 0)
            kinds = ["calls"]
            if result.timed_out:
                kinds.append("timeouts")
            elif result.error is not None:
                kinds.append("errors")
            for kind in kinds:
                last[f"reward/{kind}"] += 1
                last[f"reward/{kind}/{domain}"] += 1
        self._last = last
        for key, value in last.items():
            self._totals[key] = self._totals.get(key, 0) + value


def worker_environment(environ: Mapping[str, str], env: Mapping[str, str] | None = None,
                       passthrough: Iterable[str] = ()) -> dict[str, str]:
    """The environment of a reward worker (see the module docstring): the allow-listed variables of
    `environ`, those named in `passthrough`, then `env`, then the judge's API key variable when the result
    configures a judge and the sandbox server's key when it names one. `ValueError` naming a `passthrough`
    entry that is not a variable name."""
    from rl360.rewards.judge import ENV as JUDGE_SETTINGS
    from rl360.rewards.judge import judge_key_env
    from rl360.rewards.lewis import ENV as LISTENER_SETTINGS
    from rl360.rewards.lewis import KEY_ENV as LISTENER_KEY
    from rl360.rewards.lewis import PEER_ENV as LISTENER_PEER_SETTINGS
    from rl360.rewards.remote_sandbox import KEY_ENV as SANDBOX_KEY
    from rl360.rewards.remote_sandbox import URL_ENV as SANDBOX_URL

    names = set(passthrough_names(passthrough))
    allowed = ALLOWED_ENV.union(JUDGE_SETTINGS.values(), LISTENER_SETTINGS.values(), LISTENER_PEER_SETTINGS.values())
    chosen = {name: value for name, value in environ.items()
              if name in allowed or name in names or name.startswith(ALLOWED_ENV_PREFIXES)}
    chosen.update(env or {})
    for name, value in judge_key_env(chosen, environ).items():
        chosen.setdefault(name, value)
    if chosen.get(SANDBOX_URL, "").strip() and environ.get(SANDBOX_KEY):
        chosen.setdefault(SANDBOX_KEY, environ[SANDBOX_KEY])
    listener_key = chosen.get(LISTENER_SETTINGS["api_key_env"]) or LISTENER_KEY
    listener_url = chosen.get(LISTENER_SETTINGS["url"], "") or chosen.get(LISTENER_PEER_SETTINGS["url"], "")
    if listener_url.strip() and environ.get(listener_key):
        chosen.setdefault(listener_key, environ[listener_key])
    return chosen


def passthrough_names(names: Iterable[str]) -> list[str]:
    """`names` (`reward.env_passthrough`) checked: each a non-empty string without "=" or NUL."""
    if isinstance(names, str):
        raise ValueError(f"env_passthrough must be a list of variable names, got the string {names!r}")
    checked = []
    for name in names:
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            raise ValueError(f"env_passthrough: {name!r} is not an environment variable name")
        checked.append(name)
    return checked


def open_reward_pool(cfg: Any, routes: Mapping[str, Route] | None = None,
                     announce: Callable[[str], None] | None = None) -> RewardPool:
    """The reward pool of a training run, from its `reward` config section (`num_workers`, `timeout_s`,
    `max_memory_gb`, `judge`, `require_isolation`, `env_passthrough`). It announces one line (printed by
    default) saying what isolation untrusted code gets in the workers and what is missing, and refuses to
    start (`rl360.rewards.sandbox.IsolationError`, the pool closed) when `routes` (data_source -> its
    reward route, as `rl360.rewards.check.check_reward_data` returns them) holds one that runs the
    response's code while the isolation it requires is missing."""
    from rl360.rewards.agentic import deepeyes_env
    from rl360.rewards.judge import judge_env
    from rl360.rewards.sandbox import isolation_env, refuse_untrusted_code

    settings = {**judge_env(cfg.judge), **isolation_env(cfg.require_isolation)}
    if hasattr(cfg, "deepeyes"):
        settings.update(deepeyes_env(cfg.deepeyes))
    pool = RewardPool(cfg.num_workers, cfg.timeout_s, int(cfg.max_memory_gb * (1 << 30)) or None, env=settings,
                      env_passthrough=cfg.env_passthrough)
    try:
        found = pool.sandbox_isolation()
        (announce or _print_line)(found.summary())
        refuse_untrusted_code(routes or {}, found)
    except BaseException:
        pool.close()
        raise
    return pool


def _print_line(line: str) -> None:
    print(line, flush=True)


@contextlib.contextmanager
def _extra_environment(env: dict[str, str]):
    """`env` set in this process's environment for the block, the earlier values restored after it."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _context() -> mp.context.BaseContext:
    context = mp.get_context(_START_METHOD)
    if _START_METHOD == "forkserver":
        # Takes effect when this process's forkserver starts (at the first pool); workers forked from it
        # find the built-in rewards already imported.
        context.set_forkserver_preload(["rl360.rewards", "rl360.rewards.warm_up"])
    return context


@dataclass(frozen=True)
class _Call:
    """A message to a worker: call the function at `ref` with no arguments, send back `_call(ref)`."""

    ref: str


def _call(ref: str) -> tuple[str, Any]:
    """("ok", the value of the function at `ref` called with no arguments), or ("error", its error text)."""
    try:
        return "ok", import_ref(ref)()
    except Exception as err:
        return "error", error_text(err)


class _Worker:
    """One worker process, the parent's end of its pipe, and the call it is running (`task`)."""

    def __init__(self, context: mp.context.BaseContext, max_memory_bytes: int | None, environ: dict[str, str]):
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child_conn, max_memory_bytes, environ),
                                       name="rl360-reward-worker", daemon=True)
        self.process.start()
        child_conn.close()
        self.task: int | None = None
        self.created = time.monotonic()
        self.started: float | None = None  # when the running call's clock started (None: not ready yet)
        self.ready = False

    def deadline(self, timeout_s: float) -> float:
        """When the running call times out, or, before the worker is ready, when its start-up does."""
        return self.started + timeout_s if self.started is not None else self.created + WORKER_START_TIMEOUT_S

    def read_ready(self) -> bool:
        """Read the ready message, once the pipe or the process sentinel fired; False if the worker ended."""
        try:
            self.ready = bool(self.conn.poll()) and self.conn.recv() == _READY
        except (EOFError, OSError):
            self.ready = False
        return self.ready

    def wait_ready(self) -> bool:
        """Wait (at most the start-up limit) for the worker to be ready; False if it ended or hung instead."""
        if not self.ready and wait([self.conn, self.process.sentinel], timeout=WORKER_START_TIMEOUT_S):
            self.read_ready()
        return self.ready

    def exited(self) -> bool:
        """Whether the process has ended (read from its sentinel, so it is not reaped yet)."""
        return bool(wait([self.process.sentinel], timeout=0))

    def kill(self, grace_s: float = 0.0) -> str:
        """SIGKILL the worker's process group (the worker and whatever it started) after `grace_s` seconds
        to exit by itself, reap it, and say how it ended. The worker is still unreaped when the signal is
        sent, so its pid, which is also its group id, cannot have been reused."""
        if grace_s > 0:
            wait([self.process.sentinel], timeout=grace_s)
        for send in (os.killpg, os.kill):  # the group, or the worker alone if it had not made one yet
            try:
                send(self.process.pid, signal.SIGKILL)
                break
            except (ProcessLookupError, PermissionError):
                continue
        self.process.join(timeout=5)
        self.conn.close()
        code = self.process.exitcode
        if code is None:
            return "did not exit after SIGKILL"
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    def ask_to_exit(self) -> None:
        try:
            self.conn.send(None)
        except OSError:  # already gone
            pass


def _worker_main(conn: Connection, max_memory_bytes: int | None, environ: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)
    _no_dumps()
    os.setpgid(0, 0)  # a group of its own: a kill reaches any subprocess too, and Ctrl-C does not
    _exit_with_parent()
    if max_memory_bytes:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = max_memory_bytes if hard == resource.RLIM_INFINITY else min(max_memory_bytes, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    import rl360.rewards.warm_up  # noqa: F401  (a no-op where the forkserver imported it)

    conn.send(_READY)
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        if isinstance(message, _Call):
            conn.send(_call(message.ref))
            continue
        ref, item = message
        try:
            result = score_one(ref, item)
        except BaseException as err:  # SystemExit, KeyboardInterrupt from the reward function
            result = RewardResult(0.0, error=error_text(err))
        try:
            conn.send(result)
        except Exception as err:  # extras the pickler cannot handle; nothing was written
            conn.send(RewardResult(0.0, error=f"reward result could not be sent back: {error_text(err)}"))


def _no_dumps() -> None:
    """PR_SET_DUMPABLE 0: processes of this user cannot read this worker's /proc/<pid>/environ or memory,
    nor ptrace it (root still can); no core dumps."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):  # no C library to call: nothing to be done
        pass


def _exit_with_parent() -> None:
    """A daemon thread that ends this worker when the pool's process dies, even while a reward call
    hangs in the main thread (the pool would otherwise leave it running)."""
    parent = mp.parent_process()
    if parent is None or parent.sentinel is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="rl360-reward-parent-watch", daemon=True).start()
