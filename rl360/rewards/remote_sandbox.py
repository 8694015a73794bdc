"""Code execution for rewards, local or remote: `run_python_code` picks the backend.

With `RL360_SANDBOX_URL` set (e.g. `http://sandbox-host:8080`), code runs on a SandboxFusion-compatible
server: ByteDance's SandboxFusion, or `rl360 serve sandbox` on another machine. Otherwise it runs in the
local sandbox (`rl360.rewards.sandbox`). The variable is read at each call, so reward-pool workers that
inherit it use the same backend. `code_isolation()` says which, and what isolation the code gets.

The client speaks SandboxFusion's documented `POST /run_code`: request `{"code", "language": "python",
"stdin", "run_timeout", "compile_timeout"}`; response `{"status": "Success" | "Failed" | "SandboxError",
"message", "run_result": {"status": "Finished" | "Error" | "TimeLimitExceeded", "return_code", "stdout",
"stderr", "execution_time"}}`. A server that cannot be reached, answers late or answers nonsense gives a
`SandboxResult` with `error` set (the reward scores it 0). The whole request (connecting, sending, the
response's headers and body) has one deadline, the run timeout plus `HTTP_MARGIN_S`: every network
operation waits at most for what is left of it, so a server that sends a byte now and then cannot stretch
a call past it. The host name lookup before connecting is the system resolver's and not bounded by it.
Proxy variables are not used for the sandbox server.

`RL360_SANDBOX_API_KEY`, when set, is sent as `Authorization: Bearer <key>` (`rl360 serve sandbox
--api-key-env VAR` wants it; it never appears in an error text). A busy server's 429 or 503 is retried after
its `Retry-After` (at least `RETRY_MIN_S`) while the deadline allows; 401 (a wrong or missing key) and other
errors are not retried.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpcore
import httpx

from rl360.rewards.sandbox import Isolation, SandboxLimits, SandboxResult, isolation, isolation_required, run_python

URL_ENV = "RL360_SANDBOX_URL"
KEY_ENV = "RL360_SANDBOX_API_KEY"
HTTP_MARGIN_S = 10.0  # beyond the run timeout: queueing on the server and the round trip
RETRY_MIN_S = 0.2  # the least wait before asking a busy server (429 / 503) again
_clients: dict[str, httpx.Client] = {}
_request = threading.local()  # .deadline: time.monotonic() by which the request in progress must be done


def run_python_code(code: str, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` with `stdin` in the remote sandbox named by RL360_SANDBOX_URL, else locally (where
    `rl360.rewards.sandbox.IsolationError` says that isolation is required and missing)."""
    limits = limits or SandboxLimits()
    url = os.environ.get(URL_ENV, "").strip()
    if url:
        return run_python_remote(url, code, stdin, limits)
    return run_python(code, stdin, limits)


def code_isolation() -> Isolation:
    """What isolation code run by `run_python_code` gets in this process: the sandbox server's, when
    RL360_SANDBOX_URL names one (`remote_url` set, shown without credentials), else the local sandbox's."""
    url = os.environ.get(URL_ENV, "").strip()
    if url:
        return Isolation(required=isolation_required(), remote_url=_without_credentials(url))
    return isolation()


def run_python_remote(url: str, code: str, stdin: str, limits: SandboxLimits) -> SandboxResult:
    """One `POST {url}/run_code`, mapped to a `SandboxResult`; the whole request within the run timeout
    plus `HTTP_MARGIN_S`."""
    payload = {"code": code, "language": "python", "stdin": stdin, "run_timeout": limits.timeout_s,
               "compile_timeout": limits.timeout_s}
    endpoint = url.rstrip("/") + "/run_code"
    budget = limits.timeout_s + HTTP_MARGIN_S
    shown = _without_credentials(endpoint)
    key = os.environ.get(KEY_ENV, "")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with _deadline(budget) as deadline:
        try:
            while True:
                response = _client(url).post(endpoint, json=payload, headers=headers, timeout=budget)
                wait = _retry_wait(response)
                if wait is None or time.monotonic() + wait >= deadline:
                    break
                time.sleep(wait)  # busy: ask again while the deadline allows
            if response.status_code == 401:
                return SandboxResult(None, "", "", error=f"sandbox server {shown}: 401, the server refused the key "
                                                         f"({KEY_ENV} {'is not set' if not key else 'is wrong'})")
            response.raise_for_status()
            return from_sandbox_fusion(response.json())
        except (httpx.HTTPError, ValueError) as err:
            if isinstance(err, httpx.TimeoutException) and time.monotonic() >= deadline:
                why = (f"no complete answer within {budget:g} s (the run timeout {limits.timeout_s:g} s + "
                       f"{HTTP_MARGIN_S:g} s); the request was abandoned")
            else:
                why = f"{type(err).__name__}: {err}"
            return SandboxResult(None, "", "", error=f"sandbox server {shown}: {why}")


def _retry_wait(response: httpx.Response) -> float | None:
    """Seconds to wait before asking again when the server is busy (429, 503), else None."""
    if response.status_code not in (429, 503):
        return None
    try:
        return max(RETRY_MIN_S, float(response.headers.get("Retry-After", 0)))
    except ValueError:  # an HTTP date: not worth parsing for a short wait
        return 1.0


def from_sandbox_fusion(body: dict) -> SandboxResult:
    """A SandboxFusion `/run_code` response as a `SandboxResult`."""
    if not isinstance(body, dict) or "status" not in body:
        raise ValueError(f"not a SandboxFusion response: {str(body)[:200]}")
    run = body.get("run_result") or {}
    if body["status"] == "SandboxError" or not run:
        return SandboxResult(None, "", "", error=f"sandbox error: {body.get('message') or body['status']}")
    timed_out = run.get("status") == "TimeLimitExceeded"
    return SandboxResult(returncode=run.get("return_code"), stdout=run.get("stdout") or "",
                         stderr=run.get("stderr") or "", timed_out=timed_out,
                         wall_s=float(run.get("execution_time") or 0.0))


def to_sandbox_fusion(result: SandboxResult) -> dict:
    """A `SandboxResult` as a SandboxFusion `/run_code` response (what `rl360 serve sandbox` answers)."""
    if result.error is not None:
        return {"status": "SandboxError", "message": result.error, "compile_result": None, "run_result": None}
    if result.timed_out:
        status = "TimeLimitExceeded"
    elif result.returncode is None or result.output_truncated:
        status = "Error"
    else:
        status = "Finished"
    run = {"status": status, "execution_time": result.wall_s, "return_code": result.returncode,
           "stdout": result.stdout, "stderr": result.stderr}
    return {"status": "Success" if result.ok else "Failed", "message": result.killed_by_signal or "",
            "compile_result": None, "run_result": run}


def _client(url: str) -> httpx.Client:
    """One pooled client per server and process (reward workers make many calls), on a transport that
    keeps to the deadline of the request in progress."""
    if url not in _clients:
        _clients[url] = httpx.Client(transport=_DeadlineTransport())
    return _clients[url]


def _without_credentials(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2])) if "@" in parts.netloc else url


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[float]:
    """Every network operation of this thread's requests in the block ends by `seconds` from now."""
    _request.deadline = time.monotonic() + seconds
    try:
        yield _request.deadline
    finally:
        _request.deadline = None


def _bounded(timeout: float | None, error: type[Exception]) -> float | None:
    """`timeout` cut to what is left of the request's deadline; `error` once nothing is left."""
    deadline = getattr(_request, "deadline", None)
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise error("the request's deadline has passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose reads and writes each wait at most until the request's deadline."""

    def __init__(self, stream: httpcore.NetworkStream):
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _bounded(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _bounded(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname,
                                                      _bounded(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's socket backend, with every connection a `_DeadlineStream`."""

    def __init__(self) -> None:
        self._backend = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Any = None) -> httpcore.NetworkStream:
        stream = self._backend.connect_tcp(host, port, _bounded(timeout, httpcore.ConnectTimeout), local_address,
                                           socket_options)
        return _DeadlineStream(stream)

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Any = None) -> httpcore.NetworkStream:
        stream = self._backend.connect_unix_socket(path, _bounded(timeout, httpcore.ConnectTimeout), socket_options)
        return _DeadlineStream(stream)

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


# httpcore's errors as httpx's, most specific first (the names appear in SandboxResult.error)
_HTTPX_ERRORS = [(httpcore.ConnectTimeout, httpx.ConnectTimeout), (httpcore.ReadTimeout, httpx.ReadTimeout),
                 (httpcore.WriteTimeout, httpx.WriteTimeout), (httpcore.PoolTimeout, httpx.PoolTimeout),
                 (httpcore.ConnectError, httpx.ConnectError), (httpcore.ReadError, httpx.ReadError),
                 (httpcore.WriteError, httpx.WriteError), (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
                 (httpcore.LocalProtocolError, httpx.LocalProtocolError),
                 (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol), (httpcore.NetworkError, httpx.NetworkError),
                 (httpcore.TimeoutException, httpx.TimeoutException), (httpcore.ProtocolError, httpx.ProtocolError)]


class _DeadlineTransport(httpx.BaseTransport):
    """An httpx transport on an httpcore connection pool over `_DeadlineBackend`. It reads each response
    whole (SandboxFusion answers are small JSON documents), so the body is under the deadline too."""

    def __init__(self) -> None:
        self._pool = httpcore.ConnectionPool(ssl_context=httpx.create_ssl_context(),
                                             network_backend=_DeadlineBackend())

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = httpcore.URL(scheme=request.url.raw_scheme, host=request.url.raw_host, port=request.url.port,
                           target=request.url.raw_path)
        try:
            with self._pool.stream(request.method, url, headers=request.headers.raw, content=request.stream,
                                   extensions=request.extensions) as response:
                body = response.read()
        except (httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError,
                httpcore.UnsupportedProtocol) as err:
            raise _as_httpx(err, request) from None
        return httpx.Response(status_code=response.status, headers=response.headers, content=body,
                              extensions={key: value for key, value in response.extensions.items()
                                          if key in ("http_version", "reason_phrase")})

    def close(self) -> None:
        self._pool.close()


def _as_httpx(err: Exception, request: httpx.Request) -> httpx.HTTPError:
    for core_type, httpx_type in _HTTPX_ERRORS:
        if isinstance(err, core_type):
            return httpx_type(str(err) or type(err).__name__, request=request)
    return httpx.TransportError(str(err) or type(err).__name__, request=request)
