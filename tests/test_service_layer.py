"""The service layer under `rl360 serve ...` (rl360/service/app.py): its parts in this process, and its
behaviour in a real uvicorn process (tests/serve_layer_app.py) on 127.0.0.1: keys, limits, deadlines,
server-sent events, slow-loris senders, 413 on huge uploads, and SIGTERM during a burst."""

import itertools
import json
import os
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from urllib.parse import urlsplit

import httpx
import pytest

from rl360.serve.loadgen import MemorySampler, SlowLoris, burst, metric_total, start_service, stop_service, upload
from rl360.service.app import (
    ServiceError,
    ServiceGuard,
    ServiceLimits,
    api_key_from_env,
    is_loopback,
    json_object,
    service_app,
    service_banner,
    sse_event,
)
from rl360.service.metrics import MetricsRegistry

KEY = "Layer-Test-Key-0123456789"  # mixed case: a case-blind comparison would be caught
AUTH = {"Authorization": f"Bearer {KEY}"}
ENV = "RL360_TEST_LAYER_KEY"


def _start(*options: str, key: bool = True):
    env = {**os.environ, ENV: KEY} if key else dict(os.environ)
    argv = [sys.executable, "-m", "tests.serve_layer_app", "--port", "0", *options]
    return start_service(argv + (["--api-key-env", ENV] if key else []), env=env, timeout_s=60)


@pytest.fixture(scope="module")
def layer():
    """max 4 in flight, 3 s deadline, 2 s read timeout, 1 MiB bodies, key required."""
    proc, url = _start()
    yield url, proc
    stop_service(proc)


# ---- parts, in this process ----
def test_a_keyed_services_banner_says_how_to_send_the_key():
    app = service_app()
    assert service_banner(ServiceGuard("t", app, ServiceLimits()), "t on {url}") == "t on {url}"
    assert service_banner(ServiceGuard("t", app, ServiceLimits(), KEY), "t on {url}") == "t on {url} (API key required)"
    viewer = ServiceGuard("t", app, ServiceLimits(), KEY, browser_login=True)
    assert service_banner(viewer, "t on {url}").format(url="http://h:1") == (
        "t on http://h:1 (API key required: open http://h:1/?key=<key> once, or send 'Authorization: Bearer <key>')")



def test_metrics_render_in_prometheus_text_format():
    registry = MetricsRegistry()
    requests = registry.counter("t_requests_total", "Requests.", ["route"])
    in_flight = registry.gauge("t_in_flight", "In flight.")
    latency = registry.histogram("t_seconds", "Latency.", ["route"], buckets=(0.1, 1.0))
    requests.inc(route='/a"b\\c\n')
    requests.inc(2, route="/x")
    in_flight.set(3)
    latency.observe(0.05, route="/x")
    latency.observe(0.5, route="/x")
    assert registry.render().splitlines() == [
        "# HELP t_requests_total Requests.", "# TYPE t_requests_total counter",
        't_requests_total{route="/a\\"b\\\\c\\n"} 1', 't_requests_total{route="/x"} 2',
        "# HELP t_in_flight In flight.", "# TYPE t_in_flight gauge", "t_in_flight 3",
        "# HELP t_seconds Latency.", "# TYPE t_seconds histogram",
        't_seconds_bucket{route="/x",le="0.1"} 1', 't_seconds_bucket{route="/x",le="1"} 2',
        't_seconds_bucket{route="/x",le="+Inf"} 2', 't_seconds_sum{route="/x"} 0.55', 't_seconds_count{route="/x"} 2']
    with pytest.raises(ValueError, match="takes labels"):
        requests.inc(path="/x")
    with pytest.raises(ValueError, match="declared twice"):
        registry.gauge("t_in_flight", "again")


def test_keys_are_checked_in_full_and_never_echoed(monkeypatch):
    guard = ServiceGuard("t", service_app(), ServiceLimits(), api_key=KEY)
    assert guard.authorized(f"Bearer {KEY}".encode()) and guard.authorized(f"bearer {KEY}".encode())
    assert KEY.lower() != KEY and KEY.upper() != KEY  # so a comparison blind to case would let these in
    for header in (None, b"", KEY.encode(), f"Basic {KEY}".encode(), f"Bearer {KEY[:-1]}".encode(),
                   f"Bearer {KEY}x".encode(), b"Bearer ", f"Bearer {KEY.lower()}".encode(),
                   f"Bearer {KEY.upper()}".encode()):
        assert not guard.authorized(header), header
    assert ServiceGuard("t", service_app(), ServiceLimits()).authorized(None)  # no key: open
    monkeypatch.setenv("RL360_SHORT", "short-key")
    with pytest.raises(SystemExit, match="shorter than 16") as short:
        api_key_from_env("RL360_SHORT")
    assert "short-key" not in str(short.value)
    monkeypatch.delenv("RL360_UNSET_KEY", raising=False)
    with pytest.raises(SystemExit, match="RL360_UNSET_KEY: that environment variable is not set"):
        api_key_from_env("RL360_UNSET_KEY")
    assert api_key_from_env("") is None


def test_loopback_and_limits_and_bodies_are_checked():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "192.168.0.7", "no-such-host.invalid"))
    with pytest.raises(ValueError, match="ServiceLimits.max_in_flight must be a positive number, got 0"):
        ServiceLimits(max_in_flight=0)
    with pytest.raises(ServiceError, match="line 2 column 7") as bad:
        json_object(b'{"a": 1,\n "b": }', {"a", "b"})
    assert bad.value.status == 400
    with pytest.raises(ServiceError, match="nested too deeply"):
        json_object(b"[" * 100_000 + b"]" * 100_000, {"a"})
    with pytest.raises(ServiceError, match="must be a JSON object, got list"):
        json_object(b"[1]", {"a"})
    with pytest.raises(ServiceError, match="unknown field 'c'") as unknown:
        json_object(b'{"a": 1, "c": 2}', {"a", "b"})
    assert unknown.value.param == "c"
    assert sse_event({"i": 1}) == b'data: {"i":1}\n\n'
    assert sse_event("two\nlines", "error") == b"event: error\ndata: two\ndata: lines\n\n"


# ---- a real service process ----

def test_health_is_open_and_metrics_need_the_key(layer):
    url, _ = layer
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{url}/metrics").status_code == 401
    httpx.post(f"{url}/work", json={"tag": "m"}, headers=AUTH)
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    for line in ("# TYPE rl360_http_requests_total counter", "# TYPE rl360_http_request_duration_seconds histogram",
                 'rl360_http_requests_in_flight{service="layer-test"} 0',
                 'rl360_http_requests_total{service="layer-test",route="/work",method="POST",status="200"}',
                 'rl360_http_request_errors_total{service="layer-test",kind="unauthorized"}'):
        assert line in text, line
    assert "rl360_http_connections_open" in text


def test_wrong_or_missing_key_is_401_and_nothing_runs(layer):
    url, _ = layer
    started = metric_total(url, "rl360_test_work_started_total", AUTH)
    for headers in ({}, {"Authorization": "Bearer wrong-key-0123456789"}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": f"Bearer {KEY[:-2]}"}, {"X-Api-Key": KEY}):
        reply = httpx.post(f"{url}/work", json={"tag": "x"}, headers=headers)
        assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
        assert "API key" in reply.json()["detail"] and KEY not in reply.text
    assert metric_total(url, "rl360_test_work_started_total", AUTH) == started
    assert httpx.post(f"{url}/work", json={"tag": "y"}, headers=AUTH).json() == {"tag": "y"}
    assert metric_total(url, "rl360_test_work_started_total", AUTH) == started + 1


def test_bad_bodies_get_400_naming_the_field(layer):
    url, _ = layer
    cases = [(b'{"seconds": 1', "line 1 column 14"), (b'{"seconds": "1"}', "'seconds'"),
             (b'{"tag": 5}', "'tag'"), (b'{"tag": "a", "extra": 1}', "unknown field 'extra'"), (b"[]", "JSON object")]
    for body, named in cases:
        reply = httpx.post(f"{url}/work", content=body, headers=AUTH)
        assert reply.status_code == 400 and named in reply.json()["detail"], (body, reply.text)
    assert httpx.get(f"{url}/nowhere", headers=AUTH).json() == {"detail": "no route /nowhere"}
    assert httpx.get(f"{url}/work", headers=AUTH).status_code == 405


def test_exactly_max_in_flight_are_admitted_and_the_rest_get_429_with_retry_after():
    proc, url = _start("--request-timeout", "120")  # max 4 in flight; held requests must not reach a deadline
    try:
        with ThreadPoolExecutor(12) as threads:
            replies = [threads.submit(httpx.post, f"{url}/work", json={"hold": True, "tag": str(i)}, headers=AUTH,
                                      timeout=120) for i in range(12)]
            # the four admitted are held until SIGUSR1, so the other eight are answered first, all with 429
            rejected = list(itertools.islice(as_completed(replies, timeout=60), 8))
            assert [r.result().status_code for r in rejected] == [429] * 8
            assert all(r.result().headers["retry-after"] for r in rejected)
            assert "4 requests in flight, the most this service takes" in rejected[0].result().json()["detail"]
            assert metric_total(url, "rl360_http_requests_in_flight", AUTH) == 4
            assert metric_total(url, "rl360_test_work_started_total", AUTH) == 4
            proc.send_signal(signal.SIGUSR1)
            admitted = [r.result() for r in replies if r not in rejected]
        assert sorted(r.status_code for r in admitted) == [200] * 4
        assert metric_total(url, "rl360_http_requests_in_flight", AUTH) == 0
    finally:
        stop_service(proc)


def test_deadline_cancels_the_handler_with_504(layer):
    url, _ = layer
    cancelled = metric_total(url, "rl360_test_work_cancelled_total", AUTH)
    took = metric_total(url, "rl360_http_request_duration_seconds_sum", AUTH, route="/work")
    reply = httpx.post(f"{url}/work", json={"seconds": 30}, headers=AUTH, timeout=20)
    assert reply.status_code == 504 and "deadline of 3 s" in reply.json()["detail"]
    # from the request's headers to the end of its 504, as the service measured it: the 3 s deadline, and
    # the cancellation within a second of it
    assert 3.0 <= metric_total(url, "rl360_http_request_duration_seconds_sum", AUTH, route="/work") - took < 4.0
    assert metric_total(url, "rl360_test_work_cancelled_total", AUTH) == cancelled + 1


def test_server_sent_events_stream_and_end_with_an_error_event_at_the_deadline(layer):
    url, _ = layer
    with httpx.stream("POST", f"{url}/stream", json={"events": 3}, headers=AUTH) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = [line for line in reply.iter_lines() if line]
    assert events == ['data: {"i":0}', 'data: {"i":1}', 'data: {"i":2}', "data: [DONE]"]
    with httpx.stream("POST", f"{url}/stream", json={"events": 50, "interval_s": 1.0}, headers=AUTH,
                      timeout=20) as reply:
        lines = [line for line in reply.iter_lines() if line]
    assert 'data: {"i":0}' in lines and "data: [DONE]" not in lines
    assert lines[-2] == "event: error"
    assert json.loads(lines[-1].removeprefix("data: "))["status"] == 504


def test_a_client_that_hangs_up_has_its_handler_cancelled(layer):
    url, _ = layer
    cancelled = metric_total(url, "rl360_test_work_cancelled_total", AUTH)
    parts = urlsplit(url)
    body = b'{"seconds": 20}'
    with socket.create_connection((parts.hostname, parts.port)) as sock:
        sock.sendall(b"POST /work HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + KEY.encode() +
                     b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.5)
    ends = time.monotonic() + 10
    while metric_total(url, "rl360_test_work_cancelled_total", AUTH) == cancelled and time.monotonic() < ends:
        time.sleep(0.1)
    assert metric_total(url, "rl360_test_work_cancelled_total", AUTH) == cancelled + 1
    assert 'kind="client_disconnect"' in httpx.get(f"{url}/metrics", headers=AUTH).text


def test_huge_uploads_get_413_without_being_read(layer):
    url, proc = layer
    memory = MemorySampler(proc.pid).start()
    declared = upload(f"{url}/work", 400 << 20, headers=AUTH, declare_length=True)
    chunked = upload(f"{url}/work", 400 << 20, headers=AUTH, declare_length=False)
    memory.stop()
    assert declared.status == 413 and b"419430400 bytes is over" in declared.body
    assert chunked.status == 413 and b"over this service's limit" in chunked.body
    assert declared.bytes_sent < 64 << 20 and chunked.bytes_sent < 64 << 20  # the rest was never sent
    assert memory.peak_rss - memory.start_rss < 32 << 20, (memory.start_rss, memory.peak_rss)
    unauthorized = upload(f"{url}/work", 400 << 20, declare_length=True)  # 401 comes first, body unread
    assert unauthorized.status == 401 and unauthorized.bytes_sent < 64 << 20
    assert httpx.get(f"{url}/health").status_code == 200


def test_slow_senders_are_dropped_at_the_read_timeout(layer):
    url, _ = layer
    parts = urlsplit(url)
    loris = SlowLoris(parts.hostname, parts.port, connections=10, interval_s=0.5, duration_s=8).start()
    time.sleep(4)
    report = loris.stop()
    assert report.opened == 10 and report.closed_by_server == 10, report
    assert all(1.5 < after < 4 for after in report.closed_after_s), report.closed_after_s  # read timeout: 2 s


@pytest.mark.timeout(90)
def test_slow_loris_does_not_block_normal_requests():
    proc, url = _start("--read-timeout", "30", "--request-timeout", "5")
    try:
        parts = urlsplit(url)
        memory = MemorySampler(proc.pid).start()
        loris = SlowLoris(parts.hostname, parts.port, connections=100, interval_s=1.0, duration_s=20).start()
        latencies = []
        for i in range(10):
            began = time.monotonic()
            reply = httpx.post(f"{url}/work", json={"tag": str(i)}, headers=AUTH, timeout=5)
            latencies.append(time.monotonic() - began)
            assert reply.json() == {"tag": str(i)}
            time.sleep(0.2)
        open_now = metric_total(url, "rl360_http_connections_open", AUTH)
        report = loris.stop()
        memory.stop()
        assert report.opened == 100 and report.closed_by_server == 0, report
        assert open_now >= 100
        assert max(latencies) < 5, latencies  # each within its deadline
        assert memory.peak_rss - memory.start_rss < 48 << 20, (memory.start_rss, memory.peak_rss)
    finally:
        stop_service(proc)


@pytest.mark.timeout(120)
def test_sigterm_during_a_burst_ends_every_request_and_a_restart_answers():
    grace = 4.0
    proc, url = _start("--max-in-flight", "8", "--shutdown-grace", str(grace), "--request-timeout", "30")
    try:
        # seconds; admitted before the SIGTERM. The short ones end within the grace, but not before all eight are
        # in flight (on a loaded machine admitting them can take a second or more)
        long_work = [2.0, 2.0, 2.5, 2.5, 6.0, 10.0, 20.0, 20.0]
        with ThreadPoolExecutor(len(long_work) + 1) as threads:
            admitted = [threads.submit(httpx.post, f"{url}/work", json={"seconds": s, "tag": str(s)}, headers=AUTH,
                                       timeout=30) for s in long_work]
            ends = time.monotonic() + 20
            while metric_total(url, "rl360_http_requests_in_flight", AUTH) < len(long_work) and time.monotonic() < ends:
                time.sleep(0.05)
            assert metric_total(url, "rl360_http_requests_in_flight", AUTH) == len(long_work)
            hammer = threads.submit(burst, f"{url}/work", 2000, 16, json.dumps({"seconds": 0.01}).encode(), "POST",
                                    AUTH, 10.0, 2.5 + grace)
            time.sleep(0.5)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=grace + 10)
            exited_after = time.monotonic() - signalled
            replies = [future.result() for future in admitted]
            report = hammer.result()
        assert exited_after <= grace + 0.5, exited_after  # within the grace period (+ scheduling slack)
        for seconds, reply in zip(long_work, replies):
            if seconds <= 2.5:
                assert reply.status_code == 200 and reply.json() == {"tag": str(seconds)}
            else:
                assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
                assert reply.json() == {"detail": "cancelled: service shutting down"}
        # the burst: answered 429 (in flight full) or 503 (draining); after the listener closed, new
        # connections are refused or closed before any request was read; nothing hung
        assert set(report.statuses) <= {200, 429, 503} and report.statuses[429] > 0, report.summary()
        assert report.failures.get("timeout", 0) == 0 and report.missing_retry_after == 0, report.summary()
        assert set(report.failures) <= {"refused", "closed", "reset"}, report.summary()
    finally:
        stop_service(proc)
    proc, url = _start()
    try:
        assert httpx.post(f"{url}/work", json={"tag": "again"}, headers=AUTH).json() == {"tag": "again"}
    finally:
        stop_service(proc)
