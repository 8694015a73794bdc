"""`rl360 serve sandbox`: the local sandbox behind SandboxFusion's `POST /run_code` API.

Run it on a machine set aside for untrusted code and point trainers at it with
`RL360_SANDBOX_URL=http://HOST:PORT`. Each request runs in a worker process of a pool (the sandbox's
own uid is derived from the worker's pid, so two concurrent runs never share one); `--workers` bounds
how many run at once and further requests wait their turn. Only `language: "python"` is served; any
other language is answered with SandboxFusion's `SandboxError` status naming it. `GET /health` answers
`{"status": "ok"}`. A malformed request gets HTTP 400 with a message naming the key at fault.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from http.server import ThreadingHTTPServer

from rl360.rewards.remote_sandbox import to_sandbox_fusion
from rl360.rewards.sandbox import SandboxLimits, run_python
from rl360.serve.http import JSONHandler, serve

MAX_BODY_BYTES = 16 << 20
MAX_RUN_TIMEOUT_S = 300.0


def run_request(code: str, stdin: str, run_timeout: float) -> dict:
    """Run one request's code in this worker process; the SandboxFusion response body."""
    return to_sandbox_fusion(run_python(code, stdin, SandboxLimits(timeout_s=run_timeout)))


def parse_request(body: bytes) -> tuple[str, str, str, float]:
    """(language, code, stdin, run_timeout) of a `/run_code` body; `ValueError` naming what is wrong."""
    try:
        request = json.loads(body)
    except ValueError as err:
        raise ValueError(f"body is not JSON: {err}") from None
    if not isinstance(request, dict):
        raise ValueError("body must be a JSON object")
    code, language = request.get("code"), request.get("language")
    if not isinstance(code, str):
        raise ValueError("'code' must be a string")
    if not isinstance(language, str):
        raise ValueError("'language' must be a string")
    stdin = request.get("stdin") or ""
    if not isinstance(stdin, str):
        raise ValueError("'stdin' must be a string or null")
    timeout = request.get("run_timeout", 10)
    if not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_RUN_TIMEOUT_S:
        raise ValueError(f"'run_timeout' must be a number in (0, {MAX_RUN_TIMEOUT_S:g}], got {timeout!r}")
    return language, code, stdin, float(timeout)


class SandboxServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], workers: int):
        super().__init__(address, _Handler)
        self.pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("forkserver"))

    def server_close(self) -> None:
        super().server_close()
        self.pool.shutdown(cancel_futures=True)


class _Handler(JSONHandler):
    server: SandboxServer

    def do_GET(self) -> None:  # noqa: N802  (http.server's naming)
        if self.path.rstrip("/") == "/health":
            self.reply(200, {"status": "ok"})
        else:
            self.reply(404, {"detail": f"no route {self.path}"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path.rstrip("/") != "/run_code":
            self.reply(404, {"detail": f"no route {self.path}"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self.reply(413, {"detail": f"body of {length} bytes is over {MAX_BODY_BYTES}"})
            return
        try:
            language, code, stdin, timeout = parse_request(self.rfile.read(length))
        except ValueError as err:
            self.reply(400, {"detail": str(err)})
            return
        if language != "python":
            self.reply(200, {"status": "SandboxError", "compile_result": None, "run_result": None,
                              "message": f"language {language!r} is not supported by rl360 serve sandbox "
                                         "(python only)"})
            return
        self.reply(200, self.server.pool.submit(run_request, code, stdin, timeout).result())


def _serve(args: argparse.Namespace) -> int:
    return serve(SandboxServer((args.host, args.port), args.workers),
                 f"rl360 sandbox serving SandboxFusion's POST /run_code on {{url}} ({args.workers} workers)")


def add_sandbox_parser(services) -> None:
    sandbox = services.add_parser("sandbox", help="a SandboxFusion-compatible code sandbox (POST /run_code)")
    sandbox.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    sandbox.add_argument("--port", type=int, default=8080, help="port (0: any free port, printed at start)")
    sandbox.add_argument("--workers", type=int, default=4, help="runs at once (worker processes)")
    sandbox.set_defaults(run=_serve)
