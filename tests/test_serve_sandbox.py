"""`rl360 serve sandbox` on the service layer, as a real process on 127.0.0.1: keys (and the refusal to
listen elsewhere without one), 400s naming the field, 413 on a 400 MB upload, a burst, slow-loris senders,
and SIGTERM during a burst. The SandboxFusion API itself is covered by tests/test_remote_sandbox.py."""

import fcntl
import itertools
import json
import os
import shutil
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from urllib.parse import urlsplit

import httpx
import psutil
import pytest

from rl360.cli import main
from rl360.serve.loadgen import (
    MemorySampler,
    SlowLoris,
    burst,
    metric_total,
    service_command,
    start_service,
    stop_service,
    upload,
)

KEY = "sandbox-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENV = "RL360_TEST_SANDBOX_KEY"


def _start(*options: str):
    argv = service_command("sandbox", "--port", "0", "--api-key-env", ENV, *options)
    return start_service(argv, env={**os.environ, ENV: KEY}, timeout_s=120)


def _run(url: str, code: str, **extra) -> httpx.Response:
    return httpx.post(f"{url}/run_code", json={"code": code, "language": "python", **extra}, headers=AUTH, timeout=60)


@pytest.fixture(scope="module")
def sandbox():
    proc, url = _start("--workers", "2", "--max-in-flight", "8", "--request-timeout", "60")
    yield url, proc
    stop_service(proc)


def test_refuses_to_listen_beyond_loopback_without_a_key(monkeypatch, capsys):
    assert main(["serve", "sandbox", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "rl360: error: serve sandbox: refusing to listen on 0.0.0.0 without a key" in capsys.readouterr().err
    monkeypatch.setenv(ENV, "tiny")
    assert main(["serve", "sandbox", "--host", "0.0.0.0", "--port", "0", "--api-key-env", ENV]) == 2
    err = capsys.readouterr().err
    assert f"rl360: error: --api-key-env {ENV}: the key is shorter than 16" in err and "tiny" not in err


def test_wrong_or_missing_key_is_401_and_no_code_runs(sandbox):
    url, _ = sandbox
    assert _run(url, "print(1)").json()["run_result"]["stdout"] == "1\n"
    runs = metric_total(url, "rl360_sandbox_runs_total", AUTH)
    body = {"code": "print(2)", "language": "python"}
    for headers in ({}, {"Authorization": "Bearer not-the-key-0123456789"}, {"Authorization": KEY}):
        reply = httpx.post(f"{url}/run_code", json=body, headers=headers)
        assert reply.status_code == 401 and KEY not in reply.text
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert metric_total(url, "rl360_sandbox_runs_total", AUTH) == runs
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


@pytest.mark.parametrize("body, named", [
    (b'{"code": "print(1)", "language": ', "line 1 column 34"),
    (b'{"code": 5, "language": "python"}', "'code'"),
    (b'{"code": "", "language": ["python"]}', "'language'"),
    (b'{"code": "", "language": "python", "stdin": 3}', "'stdin'"),
    (b'{"code": "", "language": "python", "run_timeout": "5"}', "'run_timeout'"),
    (b'{"code": "", "language": "python", "compile_timeout": 0}', "'compile_timeout'"),
    (b'{"code": "", "language": "python", "memory_limit_MB": 1.5}', "'memory_limit_MB'"),
    (b'{"code": "", "language": "python", "files": {"a.txt": "eA=="}}', "'files'"),
    (b'{"code": "", "language": "python", "timeout": 5}', "unknown field 'timeout'"),
    (b'"print(1)"', "JSON object"),
])
def test_bad_requests_get_400_naming_the_field(sandbox, body, named):
    url, _ = sandbox
    reply = httpx.post(f"{url}/run_code", content=body, headers=AUTH)
    assert reply.status_code == 400 and named in reply.json()["detail"], reply.text


def test_sandbox_fusion_fields_are_accepted(sandbox):
    url, _ = sandbox
    reply = _run(url, "print(input())", stdin="hi\n", run_timeout=5, compile_timeout=5, memory_limit_MB=256,
                 files={}, fetch_files=[])
    assert reply.status_code == 200 and reply.json()["run_result"]["stdout"] == "hi\n"
    too_long = _run(url, "", run_timeout=56)  # over the request deadline (60 s) less its margin (5 s)
    assert too_long.status_code == 400 and "'run_timeout' must be a number in (0, 55]" in too_long.json()["detail"]


def test_a_400_mb_upload_gets_413_without_being_read(sandbox):
    url, proc = sandbox
    memory = MemorySampler(proc.pid).start()
    declared = upload(f"{url}/run_code", 400 << 20, headers=AUTH, declare_length=True)
    chunked = upload(f"{url}/run_code", 400 << 20, headers=AUTH, declare_length=False)
    memory.stop()
    assert declared.status == 413 and "over this service's limit of 16777216 bytes" in declared.body.decode()
    assert chunked.status == 413
    assert declared.bytes_sent < 64 << 20 and chunked.bytes_sent < 64 << 20
    assert memory.peak_rss - memory.start_rss < 48 << 20, (memory.start_rss, memory.peak_rss)  # 16 MiB read at most


def _answered(url: str) -> dict[int, float]:
    """The service's own count of /run_code requests answered 200 and 429."""
    return {status: metric_total(url, "rl360_http_requests_total", AUTH, route="/run_code", status=str(status))
            for status in (200, 429)}


@pytest.mark.timeout(120)
def test_exactly_max_in_flight_runs_are_admitted_and_the_rest_get_429(sandbox):
    url, _ = sandbox  # 8 in flight, 2 workers
    # the runs wait for a shared lock on a file this test holds exclusively: two hold the workers, six wait
    # for one, and the other four are answered 429 while all eight are in flight. The file lies outside /tmp
    # (private to each run) and is world-readable (runs may use a uid of their own)
    holder = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(__file__)), prefix=".hold-")
    try:
        os.chmod(holder, 0o755)
        lock_path = os.path.join(holder, "lock")
        with open(lock_path, "w") as lock:
            os.chmod(lock_path, 0o644)
            fcntl.flock(lock, fcntl.LOCK_EX)
            code = f"import fcntl; fcntl.flock(open({lock_path!r}), fcntl.LOCK_SH); print('ran')"
            with ThreadPoolExecutor(12) as threads:
                replies = [threads.submit(_run, url, code, run_timeout=50) for _ in range(12)]
                rejected = list(itertools.islice(as_completed(replies, timeout=60), 4))
                assert [r.result().status_code for r in rejected] == [429] * 4
                assert all(r.result().headers["retry-after"] for r in rejected)
                assert metric_total(url, "rl360_http_requests_in_flight", AUTH) == 8
                fcntl.flock(lock, fcntl.LOCK_UN)
                admitted = [r.result() for r in replies if r not in rejected]
        assert [(r.status_code, r.json()["run_result"]["stdout"]) for r in admitted] == [(200, "ran\n")] * 8
        assert metric_total(url, "rl360_http_requests_in_flight", AUTH) == 0
    finally:
        shutil.rmtree(holder)


@pytest.mark.timeout(120)
def test_a_burst_is_answered_200_or_429_with_retry_after_in_bounded_memory(sandbox):
    url, proc = sandbox
    before = _answered(url)
    memory = MemorySampler(proc.pid).start()
    report = burst(f"{url}/run_code", requests=300, clients=32, headers=AUTH, request_timeout_s=60,
                   time_limit_s=90, body=lambda i: json.dumps({"code": f"print({i})", "language": "python"}).encode())
    memory.stop()
    assert report.sent == 300 and report.answered == 300 and not report.failures, report.summary()
    assert set(report.statuses) <= {200, 429} and report.missing_retry_after == 0, report.summary()
    assert _answered(url) == {status: before[status] + report.statuses[status] for status in (200, 429)}
    assert memory.peak_rss - memory.start_rss < 64 << 20, (memory.start_rss, memory.peak_rss)
    assert metric_total(url, "rl360_http_requests_in_flight", AUTH) == 0


@pytest.mark.timeout(120)
def test_slow_loris_connections_do_not_block_a_run(sandbox):
    url, proc = sandbox
    parts = urlsplit(url)
    memory = MemorySampler(proc.pid).start()
    loris = SlowLoris(parts.hostname, parts.port, connections=100, interval_s=1.0, duration_s=30).start()
    try:
        for i in range(3):
            began = time.monotonic()
            reply = _run(url, f"print({i} * 7)", run_timeout=5)
            assert reply.json()["run_result"]["stdout"] == f"{i * 7}\n"
            assert time.monotonic() - began < 10  # well within the request deadline (60 s)
        assert metric_total(url, "rl360_http_connections_open", AUTH) >= 100
    finally:
        report = loris.stop()
        memory.stop()
    assert report.opened == 100 and report.closed_by_server == 0, report
    assert memory.peak_rss - memory.start_rss < 48 << 20, (memory.start_rss, memory.peak_rss)


@pytest.mark.timeout(240)
def test_sigterm_during_a_burst_ends_runs_and_workers_and_a_restart_answers():
    grace = 3.0
    proc, url = _start("--workers", "2", "--max-in-flight", "6", "--request-timeout", "60",
                       "--shutdown-grace", str(grace))
    try:
        runs = [0.1, 0.2, 20, 20, 20, 20]  # seconds of sleep: two finish, two run on, two wait for a worker
        with ThreadPoolExecutor(len(runs) + 1) as threads:
            admitted = []
            for seconds in runs:
                admitted.append(threads.submit(_run, url, f"import time; time.sleep({seconds}); print('slept')",
                                               run_timeout=30))
                time.sleep(0.05)
            ends = time.monotonic() + 60
            while not (admitted[0].done() and admitted[1].done()) and time.monotonic() < ends:
                time.sleep(0.05)
            assert metric_total(url, "rl360_http_requests_in_flight", AUTH) == len(runs) - 2
            descendants = psutil.Process(proc.pid).children(recursive=True)
            hammer = threads.submit(burst, f"{url}/run_code", 1000, 16,
                                    json.dumps({"code": "print(1)", "language": "python"}).encode(), "POST", AUTH,
                                    10.0, 2.0 + grace)
            time.sleep(0.5)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=grace + 30)
            exited_after = time.monotonic() - signalled
            replies = [future.result() for future in admitted]
            report = hammer.result()
        assert exited_after <= grace + 0.5, exited_after
        assert [r.status_code for r in replies] == [200, 200, 503, 503, 503, 503]
        assert all(r.json()["run_result"]["stdout"] == "slept\n" for r in replies[:2])
        assert all(r.json() == {"detail": "cancelled: service shutting down"} for r in replies[2:])
        assert set(report.statuses) <= {429, 503} and report.statuses[429] > 0, report.summary()
        assert report.failures.get("timeout", 0) == 0 and set(report.failures) <= {"refused", "closed", "reset"}
        time.sleep(0.5)
        alive = [p.pid for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, alive  # workers, the forkserver and the sandboxed runs are gone
    finally:
        stop_service(proc)
    proc, url = _start("--workers", "1")
    try:
        assert _run(url, "print('back')").json()["run_result"]["stdout"] == "back\n"
    finally:
        stop_service(proc)
