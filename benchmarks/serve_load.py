"""Load on `rl360 serve sandbox` and `rl360 serve model`: the service layer (FastAPI + uvicorn) beside the
standard-library servers it replaced, measured in the same run.

    python benchmarks/serve_load.py [--requests 2000] [--clients 64] [--slow 500] [--services sandbox,model]

For each service, each server (`stdlib`: the BASELINE copy below; `layer`: `rl360 serve ...` with its
default limits and a key) runs as a process on 127.0.0.1 and meets:

- bursts: `--requests` requests from `--clients` concurrent keep-alive clients (raw HTTP/1.1, see
  `rl360.serve.loadgen`), each with a `--request-timeout`; printed: statuses, failures by kind (reset,
  closed, timeout = a hang), p50/p99 latency of all replies and of 200s, requests answered per second and
  the server process's peak resident memory above its idle level. Sandbox bursts: `light` (language
  "cpp": answered without running code, so the HTTP layer alone) and `run` (`print(i)` run in the sandbox,
  `--workers` workers). Model burst: chat completions with `max_tokens` 1 on the quickstart's tiny model
  (built into a temporary directory).
- slow-loris: `--slow` connections that send a request's headers one byte per second for `--slow-seconds`,
  while `--probes` ordinary requests are timed one after another; printed: connections held, probe
  p50/max latency and failures, peak memory above idle.

The load generator shares the machine with the servers (the 1-minute load average is printed), so figures
from one run are comparable with each other, not across machines.

BASELINE: `StdlibSandboxServer` / `StdlibModelServer` and their handlers below are a copy of
rl360/serve/{http,sandbox,openai_api}.py's standard-library HTTP plumbing as it was before the service
layer (ThreadingHTTPServer, a thread per connection, HTTP/1.0, no limits but a body-size check). They
exist only here, as the baseline to measure against; run one with `serve_load.py baseline sandbox|model`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rl360.serve.loadgen import MemorySampler, SlowLoris, burst, service_command, start_service  # noqa: E402

KEY = "serve-load-benchmark-key-0123456789"
KEY_ENV = "RL360_SERVE_LOAD_KEY"


# ---------------------------------------------------------------------------------------------------------
# BASELINE: the standard-library servers as they were before the service layer (kept only to measure against)
# ---------------------------------------------------------------------------------------------------------

class StdlibJSONHandler(BaseHTTPRequestHandler):
    """BASELINE (old rl360/serve/http.py): JSON replies on BaseHTTPRequestHandler."""

    def reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args):  # noqa: A002  (the benchmark's output is its figures)
        pass


def stdlib_serve(server: ThreadingHTTPServer, banner: str) -> int:
    """BASELINE (old rl360/serve/http.py): print the banner, serve until SIGTERM/Ctrl-C."""
    host, port = server.server_address[:2]
    print(banner.format(url=f"http://{host}:{port}"), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def stdlib_parse_run_code(body: bytes, max_run_timeout: float = 300.0) -> tuple[str, str, str, float]:
    """BASELINE (old rl360/serve/sandbox.py): (language, code, stdin, run_timeout) or ValueError."""
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
    if not isinstance(timeout, (int, float)) or not 0 < timeout <= max_run_timeout:
        raise ValueError(f"'run_timeout' must be a number in (0, {max_run_timeout:g}], got {timeout!r}")
    return language, code, stdin, float(timeout)


class StdlibSandboxServer(ThreadingHTTPServer):
    """BASELINE (old rl360/serve/sandbox.py)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], workers: int):
        super().__init__(address, StdlibSandboxHandler)
        self.pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("forkserver"))

    def server_close(self) -> None:
        super().server_close()
        self.pool.shutdown(cancel_futures=True)


class StdlibSandboxHandler(StdlibJSONHandler):
    """BASELINE (old rl360/serve/sandbox.py)."""

    server: StdlibSandboxServer

    def do_GET(self) -> None:  # noqa: N802
        if self.path.rstrip("/") == "/health":
            self.reply(200, {"status": "ok"})
        else:
            self.reply(404, {"detail": f"no route {self.path}"})

    def do_POST(self) -> None:  # noqa: N802
        from rl360.serve.sandbox import run_request

        if self.path.rstrip("/") != "/run_code":
            self.reply(404, {"detail": f"no route {self.path}"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > 16 << 20:
            self.reply(413, {"detail": f"body of {length} bytes is over {16 << 20}"})
            return
        try:
            language, code, stdin, timeout = stdlib_parse_run_code(self.rfile.read(length))
        except ValueError as err:
            self.reply(400, {"detail": str(err)})
            return
        if language != "python":
            self.reply(200, {"status": "SandboxError", "compile_result": None, "run_result": None,
                              "message": f"language {language!r} is not supported by rl360 serve sandbox "
                                         "(python only)"})
            return
        self.reply(200, self.server.pool.submit(run_request, code, stdin, timeout).result())


class StdlibModelServer(ThreadingHTTPServer):
    """BASELINE (old rl360/serve/openai_api.py): requests wait their turn for the engine behind a lock."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], model_path: str, served_name: str, api_key: str | None):
        import hmac

        from rl360.serve.openai_api import ModelService

        self.model = ModelService(model_path, served_name)  # its engine, tokenizer and complete(): the same work
        self.served_name = served_name
        self._authorized = (lambda header: True) if not api_key else (
            lambda header: header is not None and hmac.compare_digest(header.encode(), f"Bearer {api_key}".encode()))
        self.engine_lock = threading.Lock()
        super().__init__(address, StdlibModelHandler)


class StdlibModelHandler(StdlibJSONHandler):
    """BASELINE (old rl360/serve/openai_api.py)."""

    server: StdlibModelServer

    def do_GET(self) -> None:  # noqa: N802
        from rl360.serve.openai_api import RequestError

        if self.path.rstrip("/") == "/health":
            self.reply(200, {"status": "ok"})
        elif self.path.rstrip("/") == "/v1/models" and self._check_key():
            self.reply(200, {"object": "list", "data": [{"id": self.server.served_name, "object": "model"}]})
        else:
            self.reply(404, RequestError(404, f"no route {self.path}", kind="not_found_error").body())

    def do_POST(self) -> None:  # noqa: N802
        from rl360.serve.openai_api import RequestError, parse_request

        path = self.path.rstrip("/")
        if path not in ("/v1/chat/completions", "/v1/completions"):
            self.reply(404, RequestError(404, f"no route {self.path}", kind="not_found_error").body())
            return
        if not self._check_key():
            return
        length = int(self.headers.get("Content-Length") or 0)
        try:
            if length > 4 << 20:
                raise RequestError(413, f"body of {length} bytes is over {4 << 20}")
            request = parse_request(self.rfile.read(length), path.endswith("chat/completions"),
                                    self.server.served_name)
            with self.server.engine_lock:
                body = asyncio.run(self.server.model.complete(request, path))
            self.reply(200, body)
        except RequestError as err:
            self.reply(err.status, err.body())
        except Exception as err:
            self.reply(500, RequestError(500, f"generation failed: {type(err).__name__}: {err}",
                                          kind="server_error").body())

    def _check_key(self) -> bool:
        from rl360.serve.openai_api import RequestError

        if self.server._authorized(self.headers.get("Authorization")):
            return True
        self.reply(401, RequestError(401, "missing or wrong API key", kind="authentication_error").body())
        return False


def run_baseline(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="serve_load.py baseline")
    parser.add_argument("service", choices=("sandbox", "model"))
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--model", default="")
    args = parser.parse_args(argv)
    if args.service == "sandbox":
        return stdlib_serve(StdlibSandboxServer(("127.0.0.1", args.port), args.workers),
                            "stdlib sandbox serving on {url}")
    server = StdlibModelServer(("127.0.0.1", args.port), args.model, "tiny", os.environ.get(KEY_ENV))
    return stdlib_serve(server, "stdlib model serving on {url}/v1")


# ---------------------------------------------------------------------------------------------------------
# the measurements
# ---------------------------------------------------------------------------------------------------------

def start(server: str, service: str, workers: int, model_dir: str):
    env = {**os.environ, KEY_ENV: KEY}
    if server == "stdlib":
        argv = [sys.executable, str(Path(__file__).resolve()), "baseline", service, "--port", "0"]
        argv += ["--workers", str(workers)] if service == "sandbox" else ["--model", model_dir]
    elif service == "sandbox":
        argv = service_command("sandbox", "--port", "0", "--workers", str(workers), "--api-key-env", KEY_ENV)
    else:
        argv = service_command("model", "--model", model_dir, "--port", "0", "--served-model-name", "tiny",
                               "--api-key-env", KEY_ENV)
    proc, url = start_service(argv, env=env, timeout_s=300)
    return proc, url.removesuffix("/v1")


def scenarios(service: str) -> dict[str, tuple[str, object]]:
    """name -> (path, body of request i)."""
    if service == "sandbox":
        return {"light": ("/run_code", json.dumps({"code": "print(1)", "language": "cpp"}).encode()),
                "run": ("/run_code", lambda i: json.dumps({"code": f"print({i})", "language": "python"}).encode())}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "3+4"}], "max_tokens": 1}
    return {"chat": ("/v1/chat/completions", json.dumps(chat).encode())}


def warm_up(url: str, path: str, body, clients: int, seconds: float = 180.0) -> None:
    """Wait until `clients` concurrent requests of the scenario are all answered 200 (every worker started)."""
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        report = burst(f"{url}{path}", 2 * clients, clients, body, headers={"Authorization": f"Bearer {KEY}"},
                       request_timeout_s=60, time_limit_s=60)
        if report.statuses.get(200) == 2 * clients:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{url}{path} never answered 200 to {clients} concurrent requests")


def measure_burst(proc, url: str, path: str, body, args) -> str:
    warm_up(url, path, body, args.workers)
    time.sleep(1)
    memory = MemorySampler(proc.pid).start()
    report = burst(f"{url}{path}", args.requests, args.clients, body, headers={"Authorization": f"Bearer {KEY}"},
                   request_timeout_s=args.request_timeout, time_limit_s=args.time_limit)
    memory.stop()
    ok = report.latencies(200)
    answered = report.answered
    return (f"sent {report.sent}, answered {answered} in {report.wall_s:.1f} s ({answered / report.wall_s:.0f}/s); "
            f"statuses {dict(sorted(report.statuses.items()))}; failures {dict(report.failures) or 'none'}; "
            f"429 without Retry-After {report.missing_retry_after}; all p50 {report.percentile(50) * 1e3:.1f} ms "
            f"p99 {report.percentile(99) * 1e3:.1f} ms; 200 p50 {report.percentile(50, 200) * 1e3:.1f} ms p99 "
            f"{report.percentile(99, 200) * 1e3:.1f} ms (n={len(ok)}); peak RSS "
            f"+{(memory.peak_rss - memory.start_rss) / (1 << 20):.1f} MiB over {memory.start_rss / (1 << 20):.0f} MiB")


def measure_slow_loris(proc, url: str, path: str, body, args) -> str:
    import httpx

    parts = urlsplit(url)
    memory = MemorySampler(proc.pid).start()
    loris = SlowLoris(parts.hostname, parts.port, args.slow, interval_s=1.0, duration_s=args.slow_seconds).start()
    latencies, failures = [], 0
    with httpx.Client(headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}) as client:
        for i in range(args.probes):
            began = time.monotonic()
            try:
                reply = client.post(f"{url}{path}", content=body(i) if callable(body) else body, timeout=30)
                if reply.status_code != 200:
                    failures += 1
            except httpx.HTTPError:
                failures += 1
            latencies.append(time.monotonic() - began)
            time.sleep(0.1)
    report = loris.stop()
    memory.stop()
    return (f"{report.opened} slow connections held ({report.refused} refused, {report.closed_by_server} closed by the "
            f"server); {args.probes} probes: p50 {statistics.median(latencies) * 1e3:.1f} ms max "
            f"{max(latencies) * 1e3:.1f} ms, {failures} failed; peak RSS "
            f"+{(memory.peak_rss - memory.start_rss) / (1 << 20):.1f} MiB over {memory.start_rss / (1 << 20):.0f} MiB")


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except Exception:
        proc.kill()
        proc.wait()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "baseline":
        return run_baseline(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", default="sandbox,model")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--request-timeout", type=float, default=120.0, help="a reply later than this is a hang")
    parser.add_argument("--time-limit", type=float, default=600.0, help="no new request after this many seconds")
    parser.add_argument("--slow", type=int, default=500, help="slow-loris connections")
    parser.add_argument("--slow-seconds", type=float, default=25.0)
    parser.add_argument("--probes", type=int, default=40)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; {args.requests} requests from "
          f"{args.clients} clients; {args.slow} slow-loris connections", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = ""
        if "model" in args.services:
            from rl360.quickstart.assets import build_quickstart_model

            model_dir = str(build_quickstart_model(Path(tmp) / "model"))
        for service in args.services.split(","):
            for server in ("stdlib", "layer"):
                proc, url = start(server, service, args.workers, model_dir)
                try:
                    for name, (path, body) in scenarios(service).items():
                        figures = measure_burst(proc, url, path, body, args)
                        print(f"{service:8s} {name:6s} burst      {server:6s} | {figures}", flush=True)
                    path, body = next(iter(scenarios(service).values()))
                    print(f"{service:8s} {'':6s} slow-loris {server:6s} | "
                          f"{measure_slow_loris(proc, url, path, body, args)}", flush=True)
                finally:
                    stop(proc)
    print(f"load average {os.getloadavg()[0]:.2f} at the end", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
