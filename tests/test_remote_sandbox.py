"""Remote code execution: `rl360 serve sandbox` (a real server process) and the SandboxFusion client."""

import json
import subprocess
import sys

import httpx
import pytest

from rl360.network import free_port
from rl360.rewards.codegen import codegen_score
from rl360.rewards.remote_sandbox import KEY_ENV, URL_ENV, from_sandbox_fusion, run_python_code, run_python_remote
from rl360.rewards.sandbox import SandboxLimits

ECHO_SUM = "```python\nprint(sum(int(x) for x in input().split()))\n```"
TRUTH = json.dumps({"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]})


@pytest.fixture(scope="module")
def server_url():
    proc = subprocess.Popen([sys.executable, "-m", "rl360.cli", "serve", "sandbox", "--port", "0", "--workers", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()  # "rl360 sandbox serving ... on http://127.0.0.1:PORT (2 workers)"
    assert "serving" in line, line
    url = line.split(" on ", 1)[1].split()[0]
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def test_codegen_reward_scores_through_the_server(server_url, monkeypatch):
    monkeypatch.setenv(URL_ENV, server_url)
    assert codegen_score(ECHO_SUM, TRUTH)["score"] == 1.0
    wrong = codegen_score("```python\nprint(0)\n```", TRUTH)
    assert wrong["score"] == 0.0 and wrong["failure"] == "case 0: wrong answer"
    crash = codegen_score("```python\nraise SystemExit(3)\n```", TRUTH)
    assert crash["score"] == 0.0 and "exit code 3" in crash["failure"]


def test_timeouts_and_errors_come_back_as_results(server_url):
    slow = run_python_remote(server_url, "while True: pass", "", SandboxLimits(timeout_s=1.0))
    assert slow.timed_out and not slow.ok
    ran = run_python_remote(server_url, "import sys; print(sys.stdin.read().upper())", "abc", SandboxLimits())
    assert ran.ok and ran.stdout == "ABC\n"


def test_server_names_unsupported_languages_and_bad_requests(server_url):
    other = httpx.post(f"{server_url}/run_code", json={"code": "int main(){}", "language": "cpp"}).json()
    assert other["status"] == "SandboxError" and "'cpp'" in other["message"]
    bad = httpx.post(f"{server_url}/run_code", json={"language": "python"})
    assert bad.status_code == 400 and "'code'" in bad.json()["detail"]
    too_long = httpx.post(f"{server_url}/run_code", json={"code": "", "language": "python", "run_timeout": 1e9})
    assert too_long.status_code == 400 and "run_timeout" in too_long.json()["detail"]
    assert httpx.get(f"{server_url}/health").json() == {"status": "ok"}


def test_unreachable_server_is_an_error_result_not_a_hang(monkeypatch):
    monkeypatch.setenv(URL_ENV, f"http://127.0.0.1:{free_port()}")
    result = run_python_code("print(1)", limits=SandboxLimits(timeout_s=1.0))
    assert result.error is not None and "ConnectError" in result.error
    assert codegen_score(ECHO_SUM, TRUTH)["score"] == 0.0


def test_client_payload_and_response_follow_sandbox_fusion_docs(monkeypatch):
    """SandboxFusion itself (a container service) is not installed here: pin the request the client sends
    and its reading of a response shaped as SandboxFusion's API reference documents for POST /run_code."""
    import rl360.rewards.remote_sandbox as remote

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, str(request.url), json.loads(request.content)))
        return httpx.Response(200, json={
            "status": "Success", "message": "", "compile_result": None,
            "run_result": {"status": "Finished", "execution_time": 0.02, "return_code": 0, "stdout": "3\n",
                           "stderr": ""},
            "executor_pod_name": None, "files": {}})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    monkeypatch.setattr(remote, "_clients", {"http://fusion:8080": client})
    result = run_python_remote("http://fusion:8080", "print(3)", "x", SandboxLimits(timeout_s=2.0))
    assert seen == [("POST", "http://fusion:8080/run_code",
                     {"code": "print(3)", "language": "python", "stdin": "x", "run_timeout": 2.0,
                      "compile_timeout": 2.0})]
    assert result.ok and result.stdout == "3\n"
    timed = from_sandbox_fusion({"status": "Failed", "message": "", "run_result": {
        "status": "TimeLimitExceeded", "execution_time": 2.0, "return_code": None, "stdout": "", "stderr": ""}})
    assert timed.timed_out and not timed.ok
    assert from_sandbox_fusion({"status": "SandboxError", "message": "no runner"}).error == "sandbox error: no runner"


class DrippingServer:
    """A local HTTP server (a thread on 127.0.0.1) that answers every request slowly: `mode` "headers" drips
    its status line and headers one byte every `every_s` seconds, "body" sends the headers at once and drips
    a long JSON body. Each answer stops after `max_s` seconds and the server shuts itself down on `stop()`,
    so nothing outlives the test. `answers_started` counts the requests it began to answer."""

    def __init__(self, mode: str, every_s: float = 0.05, max_s: float = 8.0):
        import socket
        import threading

        self.mode, self.every_s, self.max_s = mode, every_s, max_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.stopping = threading.Event()
        self.answers_started = 0
        self.thread = threading.Thread(target=self._serve, name="dripping-server", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)
        self.listener.close()
        assert not self.thread.is_alive()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                self._answer(conn)

    def _answer(self, conn) -> None:
        import time

        conn.settimeout(1.0)
        request = b""
        while b"\r\n\r\n" not in request:  # the client's request headers (its small body follows; unread)
            chunk = conn.recv(65536)
            if not chunk:
                return
            request += chunk
        self.answers_started += 1
        body = json.dumps({"status": "Success", "message": "", "run_result": {
            "status": "Finished", "return_code": 0, "stdout": "x" * 100_000, "stderr": "", "execution_time": 0.1}})
        head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        if self.mode == "body":
            conn.sendall(head.encode())
        dripped = (head + body if self.mode == "headers" else body).encode()
        ends = time.monotonic() + self.max_s
        for index in range(len(dripped)):
            if self.stopping.is_set() or time.monotonic() > ends:
                return
            try:
                conn.sendall(dripped[index:index + 1])
            except OSError:  # the client gave up and closed the connection
                return
            time.sleep(self.every_s)


@pytest.mark.parametrize("mode", ["headers", "body"])
def test_a_dripping_server_cannot_stretch_a_call_past_its_deadline(mode, monkeypatch):
    """Each byte arrives well within any per-read timeout, yet the whole call must end at the run timeout
    plus the margin (0.5 s + 0.5 s here) with an error that says so; before, every byte reset the wait."""
    import time

    import rl360.rewards.remote_sandbox as remote

    monkeypatch.setattr(remote, "HTTP_MARGIN_S", 0.5)
    monkeypatch.setattr(remote, "_clients", {})
    server = DrippingServer(mode)
    try:
        started = time.monotonic()
        result = run_python_remote(server.url, "print(1)", "", SandboxLimits(timeout_s=0.5))
        elapsed = time.monotonic() - started
    finally:
        server.stop()
    assert server.answers_started >= 1  # it did answer, slowly
    assert 0.9 <= elapsed < 3.0, elapsed
    assert not result.ok and result.returncode is None
    assert result.error.startswith(f"sandbox server {server.url}/run_code: no complete answer within 1 s")


def test_code_isolation_names_the_server_without_its_credentials(monkeypatch):
    from rl360.rewards.remote_sandbox import code_isolation

    monkeypatch.setenv(URL_ENV, "http://user:hunter2@sandbox-host:8080")
    monkeypatch.setenv("RL360_SANDBOX_ISOLATION", "none")  # local isolation does not matter for remote code
    found = code_isolation()
    assert found.remote_url == "http://sandbox-host:8080" and not found.refuses
    assert found.summary() == ("rl360 sandbox: untrusted code runs on the sandbox server http://sandbox-host:8080 "
                               "(RL360_SANDBOX_URL); its isolation is that server's")


def test_the_key_reaches_a_keyed_server_and_never_an_error_text(monkeypatch):
    import os

    key = "k3y-for-the-sandbox-0123456789"
    env = {**os.environ, "RL360_TEST_SANDBOX_KEY": key}
    proc = subprocess.Popen([sys.executable, "-m", "rl360.cli", "serve", "sandbox", "--port", "0", "--workers", "1",
                             "--api-key-env", "RL360_TEST_SANDBOX_KEY"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "serving" in line, line
        url = line.split(" on ", 1)[1].split()[0]
        monkeypatch.setenv(URL_ENV, url)
        monkeypatch.delenv(KEY_ENV, raising=False)
        missing = run_python_code("print(1)")
        assert missing.error.endswith("401, the server refused the key (RL360_SANDBOX_API_KEY is not set)")
        monkeypatch.setenv(KEY_ENV, "wrong-" + key)
        wrong = run_python_code("print(1)")
        assert wrong.error.endswith("is wrong)") and key not in wrong.error
        monkeypatch.setenv(KEY_ENV, key)
        assert run_python_code("print(6 * 7)").stdout == "42\n"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class BusyServer:
    """A local server that answers 429 (or 503) with Retry-After: 0 to its first `busy` requests, then a
    SandboxFusion success; it counts the requests and the Authorization headers it saw."""

    def __init__(self, busy: int, status: int = 429):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                server.requests += 1
                server.auth.append(self.headers.get("Authorization"))
                if server.requests <= busy:
                    body, code, extra = b'{"detail": "busy"}', status, {"Retry-After": "0"}
                else:
                    body, code, extra = json.dumps({"status": "Success", "message": "", "run_result": {
                        "status": "Finished", "return_code": 0, "stdout": "ok\n", "stderr": "",
                        "execution_time": 0.01}}).encode(), 200, {}
                self.send_response(code)
                for name, value in {"Content-Length": str(len(body)), **extra}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.requests, self.auth = 0, []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("status", [429, 503])
def test_a_busy_server_is_asked_again_within_the_deadline(status, monkeypatch):
    import time

    import rl360.rewards.remote_sandbox as remote

    monkeypatch.setattr(remote, "_clients", {})
    monkeypatch.setenv(KEY_ENV, "a-key-of-sixteen-chars")
    server = BusyServer(busy=2, status=status)
    try:
        result = run_python_remote(server.url, "print(1)", "", SandboxLimits(timeout_s=5.0))
        assert result.ok and result.stdout == "ok\n" and server.requests == 3
        assert server.auth == ["Bearer a-key-of-sixteen-chars"] * 3
        monkeypatch.setattr(remote, "HTTP_MARGIN_S", 0.5)
        always = BusyServer(busy=10**6, status=status)
        started = time.monotonic()
        late = run_python_remote(always.url, "print(1)", "", SandboxLimits(timeout_s=0.5))
        always.stop()
        assert time.monotonic() - started < 3.0 and always.requests >= 2  # retried, then gave up in time
        assert late.returncode is None and f"{status}" in late.error
    finally:
        server.stop()


def test_reward_workers_get_the_sandbox_key_only_with_a_sandbox_url():
    from rl360.rewards.pool import worker_environment

    environ = {"PATH": "/bin", KEY_ENV: "secret-sandbox-key", "WANDB_API_KEY": "w"}
    assert worker_environment(environ) == {"PATH": "/bin"}
    with_url = worker_environment({**environ, URL_ENV: "http://sandbox:8080"})
    assert with_url == {"PATH": "/bin", URL_ENV: "http://sandbox:8080", KEY_ENV: "secret-sandbox-key"}
