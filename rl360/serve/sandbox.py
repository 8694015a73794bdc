"""`rl360 serve sandbox`: the local sandbox behind SandboxFusion's `POST /run_code` API.

    RL360_SANDBOX_KEY=... rl360 serve sandbox --host 0.0.0.0 --port 8080 --api-key-env RL360_SANDBOX_KEY
                          [--workers 4] [--max-in-flight 256] [--request-timeout 360] [--shutdown-grace 30] ...

Run it on a machine set aside for untrusted code and point trainers at it with
`RL360_SANDBOX_URL=http://HOST:PORT`. It runs on the service layer (`rl360.service.app`: keys, limits,
deadlines, graceful shutdown, `/health`, `/metrics`). It runs code for whoever can reach it, so it refuses
to listen on anything but a loopback address without a key (`--api-key-env VAR`; clients then send
`Authorization: Bearer <key>`).

Each request runs in a worker process of a pool (the sandbox's own uid is derived from the worker's pid, so
two concurrent runs never share one); `--workers` bounds how many run at once, and admitted requests wait
for a worker (`--max-in-flight` bounds those, beyond it 429). A request cancelled before its turn (its
client left, its deadline passed, the service is shutting down) never runs.

The request is SandboxFusion's `RunCodeRequest`: `code` and `language` (strings), `stdin` (string or null),
`run_timeout` and `compile_timeout` (seconds, > 0, at most `MAX_RUN_TIMEOUT_S` and the request deadline
less a margin), `memory_limit_MB` (-1: the default of 2 GiB; else up to that), `files` and `fetch_files`
(accepted only empty). Only `language: "python"` is served; any other language is answered with
SandboxFusion's `SandboxError` status naming it. Malformed JSON, wrong types and unknown fields get 400
with `detail` naming the field. The service's metrics add `rl360_sandbox_runs_total` by run status.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse

from rl360.rewards.remote_sandbox import to_sandbox_fusion
from rl360.rewards.sandbox import IsolationError, SandboxLimits, isolation, run_python
from rl360.service.app import (
    ServiceError,
    ServiceGuard,
    ServiceLimits,
    add_service_arguments,
    json_object,
    run_service,
    service_app,
    service_options,
)
from rl360.service.metrics import MetricsRegistry

MAX_RUN_TIMEOUT_S = 300.0
DEADLINE_MARGIN_S = 5.0  # a run's timeout must leave this much of the request deadline (startup, reply)
DEFAULT_MEMORY_MB = SandboxLimits().memory_bytes >> 20
DEFAULT_LIMITS = ServiceLimits(max_body_bytes=16 << 20, max_in_flight=256,
                               request_timeout_s=MAX_RUN_TIMEOUT_S + 60.0, read_timeout_s=30.0, shutdown_grace_s=30.0)
FIELDS = ("code", "language", "stdin", "run_timeout", "compile_timeout", "memory_limit_MB", "files", "fetch_files")


@dataclass
class RunCode:
    """A parsed `/run_code` request."""

    language: str
    code: str
    stdin: str = ""
    run_timeout: float = 10.0
    memory_mb: int = DEFAULT_MEMORY_MB


def parse_request(body: bytes, max_run_timeout: float = MAX_RUN_TIMEOUT_S) -> RunCode:
    """The request in `body`; `ServiceError(400)` naming the field at fault."""
    request = json_object(body, FIELDS)
    code, language = request.get("code"), request.get("language")
    if not isinstance(code, str):
        raise ServiceError(400, f"'code' must be a string, got {_type(code)}", "code")
    if not isinstance(language, str):
        raise ServiceError(400, f"'language' must be a string, got {_type(language)}", "language")
    stdin = request.get("stdin")
    if stdin is not None and not isinstance(stdin, str):
        raise ServiceError(400, f"'stdin' must be a string or null, got {_type(stdin)}", "stdin")
    timeout = _seconds(request, "run_timeout", max_run_timeout)
    _seconds(request, "compile_timeout", max_run_timeout)  # nothing is compiled for python; checked all the same
    memory = request.get("memory_limit_MB", -1)
    if memory is None:
        memory = -1
    if isinstance(memory, bool) or not isinstance(memory, int) or not (memory == -1 or 0 < memory <= DEFAULT_MEMORY_MB):
        raise ServiceError(400, f"'memory_limit_MB' must be -1 (default, {DEFAULT_MEMORY_MB}) or an integer in "
                                f"[1, {DEFAULT_MEMORY_MB}], got {memory!r}", "memory_limit_MB")
    for key, kind in (("files", dict), ("fetch_files", list)):
        value = request.get(key)
        if value is not None and not isinstance(value, kind):
            raise ServiceError(400, f"'{key}' must be {'an object' if kind is dict else 'a list'}, got {_type(value)}",
                               key)
        if value:
            raise ServiceError(400, f"'{key}' is not supported by rl360 serve sandbox (send it empty)", key)
    return RunCode(language, code, stdin or "", timeout, DEFAULT_MEMORY_MB if memory == -1 else memory)


def _seconds(request: dict, key: str, high: float) -> float:
    value = request.get(key)
    if value is None:
        return 10.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= high:
        raise ServiceError(400, f"'{key}' must be a number in (0, {high:g}], got {value!r}", key)
    return float(value)


def _type(value: object) -> str:
    return "null" if value is None else type(value).__name__


def run_request(code: str, stdin: str, run_timeout: float, memory_mb: int = DEFAULT_MEMORY_MB) -> dict:
    """Run one request's code in this worker process; the SandboxFusion response body."""
    limits = SandboxLimits(timeout_s=run_timeout, memory_bytes=memory_mb << 20)
    try:
        return to_sandbox_fusion(run_python(code, stdin, limits))
    except IsolationError as err:  # this machine cannot isolate it, and isolation is required
        return {"status": "SandboxError", "message": str(err), "compile_result": None, "run_result": None}


def _worker_start() -> None:
    """In each worker: SIGTERM ends a run cleanly (its sandbox is killed and removed by run_python's own
    cleanup); Ctrl-C in the terminal is the server's to handle, not the workers'."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def _warm_up() -> int:
    return 0


class SandboxService:
    """The worker pool and the routes; `guard` is what uvicorn runs."""

    def __init__(self, workers: int, limits: ServiceLimits, api_key: str | None):
        if workers < 1:
            raise SystemExit(f"--workers must be at least 1, got {workers}")
        self.workers = workers
        self.max_run_timeout = min(MAX_RUN_TIMEOUT_S, limits.request_timeout_s - DEADLINE_MARGIN_S)
        if self.max_run_timeout <= 0:
            raise SystemExit(f"--request-timeout must be over {DEADLINE_MARGIN_S:g} s (runs need time), "
                             f"got {limits.request_timeout_s:g}")
        self.pool: ProcessPoolExecutor | None = None
        registry = MetricsRegistry()
        self.runs = registry.counter("rl360_sandbox_runs_total", "Code runs finished, by SandboxFusion run status.",
                                     ["status"])
        app = service_app(lifespan=self._lifespan)
        app.add_api_route("/run_code", self.run_code, methods=["POST"])
        self.guard = ServiceGuard("sandbox", app, limits, api_key, registry=registry)

    @asynccontextmanager
    async def _lifespan(self, app):
        self.pool = self._new_pool()
        for _ in range(self.workers):  # start the workers now (their imports take seconds), not on first use
            self.pool.submit(_warm_up)
        try:
            yield
        finally:
            self.close()

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context("forkserver"),
                                   initializer=_worker_start)

    async def run_code(self, request: Request) -> JSONResponse:
        run = parse_request(await request.body(), self.max_run_timeout)
        if run.language != "python":
            return JSONResponse({"status": "SandboxError", "compile_result": None, "run_result": None,
                                 "message": f"language {run.language!r} is not supported by rl360 serve sandbox "
                                            "(python only)"})
        pool = self.pool
        try:
            result = await asyncio.wrap_future(pool.submit(run_request, run.code, run.stdin, run.run_timeout,
                                                           run.memory_mb))
        except BrokenProcessPool:
            if self.pool is pool and not self.guard.draining:  # a worker died: the next request gets a new pool
                self.pool = self._new_pool()
                pool.shutdown(wait=False, cancel_futures=True)
            raise ServiceError(500, "a sandbox worker process died during this run; retry it") from None
        self.runs.inc(status=(result.get("run_result") or {}).get("status") or result["status"])
        return JSONResponse(result)

    def close(self, wait_s: float = 0.2) -> None:
        """Stop the pool: queued runs are dropped, running ones get SIGTERM (SIGKILL after `wait_s`)."""
        pool, self.pool = self.pool, None
        if pool is None:
            return
        processes = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            with suppress(OSError, ValueError):
                process.terminate()
        ends = time.monotonic() + wait_s
        for process in processes:
            process.join(max(0.0, ends - time.monotonic()))
            if process.is_alive():
                with suppress(OSError, ValueError):
                    process.kill()


def _serve(args: argparse.Namespace) -> int:
    api_key, limits = service_options(args, "sandbox", "it runs code for whoever reaches it")
    service = SandboxService(args.workers, limits, api_key)
    print(isolation().summary(), file=sys.stderr, flush=True)  # what the code gets here (stdout: the banner)
    return run_service(service.guard, args.host, args.port,
                       f"rl360 sandbox serving SandboxFusion's POST /run_code on {{url}} ({args.workers} workers)",
                       access_log=args.access_log)


def add_sandbox_parser(services) -> None:
    sandbox = services.add_parser("sandbox", help="a SandboxFusion-compatible code sandbox (POST /run_code)")
    add_service_arguments(sandbox, port=8080, defaults=DEFAULT_LIMITS)
    sandbox.add_argument("--workers", type=int, default=4, help="runs at once (worker processes)")
    sandbox.set_defaults(run=_serve)
