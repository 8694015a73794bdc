"""Code execution for rewards, local or remote: `run_python_code` picks the backend.

With `RL360_SANDBOX_URL` set (e.g. `http://sandbox-host:8080`), code runs on a SandboxFusion-compatible
server: ByteDance's SandboxFusion, or `rl360 serve sandbox` on another machine. Otherwise it runs in the
local sandbox (`rl360.rewards.sandbox`). The variable is read at each call, so reward-pool workers that
inherit it use the same backend.

The client speaks SandboxFusion's documented `POST /run_code`: request `{"code", "language": "python",
"stdin", "run_timeout", "compile_timeout"}`; response `{"status": "Success" | "Failed" | "SandboxError",
"message", "run_result": {"status": "Finished" | "Error" | "TimeLimitExceeded", "return_code", "stdout",
"stderr", "execution_time"}}`. A server that cannot be reached, answers late or answers nonsense gives a
`SandboxResult` with `error` set (the reward scores it 0); nothing waits longer than the run timeout plus
`HTTP_MARGIN_S`.
"""

from __future__ import annotations

import os

import httpx

from rl360.rewards.sandbox import SandboxLimits, SandboxResult, run_python

URL_ENV = "RL360_SANDBOX_URL"
HTTP_MARGIN_S = 10.0  # beyond the run timeout: queueing on the server and the round trip
_clients: dict[str, httpx.Client] = {}


def run_python_code(code: str, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` with `stdin` in the remote sandbox named by RL360_SANDBOX_URL, else locally."""
    limits = limits or SandboxLimits()
    url = os.environ.get(URL_ENV, "").strip()
    if url:
        return run_python_remote(url, code, stdin, limits)
    return run_python(code, stdin, limits)


def run_python_remote(url: str, code: str, stdin: str, limits: SandboxLimits) -> SandboxResult:
    """One `POST {url}/run_code`, mapped to a `SandboxResult`."""
    payload = {"code": code, "language": "python", "stdin": stdin, "run_timeout": limits.timeout_s,
               "compile_timeout": limits.timeout_s}
    endpoint = url.rstrip("/") + "/run_code"
    try:
        response = _client(url).post(endpoint, json=payload, timeout=limits.timeout_s + HTTP_MARGIN_S)
        response.raise_for_status()
        return from_sandbox_fusion(response.json())
    except (httpx.HTTPError, ValueError) as err:
        return SandboxResult(None, "", "", error=f"sandbox server {endpoint}: {type(err).__name__}: {err}")


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
    """One pooled client per server and process (reward workers make many calls)."""
    if url not in _clients:
        _clients[url] = httpx.Client()
    return _clients[url]
