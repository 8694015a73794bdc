"""Remote code execution: `rl360 serve sandbox` (a real server process) and the SandboxFusion client."""

import json
import subprocess
import sys

import httpx
import pytest

from rl360.network import free_port
from rl360.rewards.codegen import codegen_score
from rl360.rewards.remote_sandbox import URL_ENV, from_sandbox_fusion, run_python_code, run_python_remote
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
