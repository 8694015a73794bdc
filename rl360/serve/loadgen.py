"""Load and fault generators for our HTTP services, used by the tests and `benchmarks/serve_load.py`.

They speak raw HTTP/1.1 over sockets, so what a server did is seen as it happened: answered (status,
`Retry-After`, latency), reset the connection, closed it without a reply, or let the request hang past
its timeout. Every loop is bounded in count and in time and stops by itself.

- `start_service(argv)`: run `rl360 serve ...` (or any command printing "... on http://HOST:PORT ...") as a
  process; returns it and the URL from its banner.
- `burst(url, requests, clients, ...)`: `requests` requests from `clients` concurrent keep-alive clients;
  a `BurstReport` with statuses, latencies (p50/p99), failures by kind and 429s lacking `Retry-After`.
- `SlowLoris(host, port, connections, interval_s, duration_s)`: connections that send a request's headers
  one byte per `interval_s` from a background thread; `.stop()` says how many the server closed.
- `upload(url, total_bytes, ...)`: one POST streaming `total_bytes` from a generator (with Content-Length,
  or chunked), reading the reply as soon as it comes; says how many bytes went out before it.
- `MemorySampler(pid)`: peak resident memory of a process (and its children) while it runs.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import psutil


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    keep_alive: bool


def start_service(argv: list[str], env: dict[str, str] | None = None, timeout_s: float = 120.0,
                  stderr=subprocess.DEVNULL) -> tuple[subprocess.Popen, str]:
    """Start `argv` and wait (at most `timeout_s`) for its banner; (process, base URL). Output after the
    banner is left unread unless `stderr` says otherwise."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    ends = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < ends:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, ends - time.monotonic()))
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if " on http://" in line:
            return proc, line.split(" on ", 1)[1].split()[0]
    proc.kill()
    proc.wait()
    raise RuntimeError(f"{' '.join(argv[:6])} ... printed no banner within {timeout_s:g} s (exit code "
                       f"{proc.returncode}); output: {''.join(seen)[-2000:]!r}")


def metric_total(url: str, name: str, headers: dict[str, str] | None = None, timeout_s: float = 10.0,
                 **labels: str) -> float:
    """The sum of every series of metric `name` in the service's `/metrics` at `url` whose labels include
    `labels` (none given: every series)."""
    import httpx

    text = httpx.get(f"{url}/metrics", headers=headers, timeout=timeout_s).text
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{")[0].split(" ")[0] == name
               and all(label in line.split("{", 1)[-1].rsplit("}", 1)[0] for label in wanted))


def stop_service(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if the process is not gone within `timeout_s`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def request_bytes(method: str, url: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    parts = urlsplit(url)
    lines = [f"{method} {parts.path or '/'}{'?' + parts.query if parts.query else ''} HTTP/1.1",
             f"Host: {parts.netloc}"]
    if body or method in ("POST", "PUT"):
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def read_reply(reader: asyncio.StreamReader) -> Reply:
    """One HTTP/1.x reply (Content-Length, chunked, or up to EOF)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    version, status = lines[0].split(" ", 2)[:2]
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    keep_alive = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        chunks = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            chunks.append((await reader.readexactly(size + 2))[:size])
            if size == 0:
                break
        body = b"".join(chunks)
    else:
        body, keep_alive = await reader.read(), False
    return Reply(int(status), headers, body, keep_alive)


@dataclass
class BurstReport:
    sent: int = 0
    statuses: Counter = field(default_factory=Counter)
    latencies_s: dict[int, list[float]] = field(default_factory=dict)  # by status
    failures: Counter = field(default_factory=Counter)  # reset, closed, timeout, refused
    missing_retry_after: int = 0
    wall_s: float = 0.0

    @property
    def answered(self) -> int:
        return sum(self.statuses.values())

    def latencies(self, status: int | None = None) -> list[float]:
        if status is not None:
            return sorted(self.latencies_s.get(status, []))
        return sorted(x for values in self.latencies_s.values() for x in values)

    def percentile(self, q: float, status: int | None = None) -> float:
        values = self.latencies(status)
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q / 100 * len(values)))]

    def summary(self) -> str:
        statuses = ", ".join(f"{status}: {count}" for status, count in sorted(self.statuses.items()))
        failures = ", ".join(f"{kind}: {count}" for kind, count in sorted(self.failures.items())) or "none"
        per_status = "; ".join(f"{status} p50 {self.percentile(50, status) * 1e3:.1f} ms p99 "
                               f"{self.percentile(99, status) * 1e3:.1f} ms" for status in sorted(self.statuses))
        return (f"{self.sent} sent in {self.wall_s:.1f} s ({self.answered / max(self.wall_s, 1e-9):.0f}/s answered); "
                f"statuses {{{statuses}}}; failures {failures}; 429 without Retry-After: {self.missing_retry_after}; "
                f"all p50 {self.percentile(50) * 1e3:.1f} ms p99 {self.percentile(99) * 1e3:.1f} ms; {per_status}")


def burst(url: str, requests: int, clients: int, body: Callable[[int], bytes] | bytes = b"", method: str = "POST",
          headers: dict[str, str] | None = None, request_timeout_s: float = 30.0,
          time_limit_s: float = 120.0) -> BurstReport:
    """`requests` requests to `url` from `clients` concurrent clients, each on a kept-alive connection
    (reopened when the server closes it). No new request starts after `time_limit_s`."""
    return asyncio.run(_burst(url, requests, clients, body, method, headers, request_timeout_s, time_limit_s))


async def _burst(url, requests, clients, body, method, headers, request_timeout_s, time_limit_s) -> BurstReport:
    report = BurstReport()
    parts = urlsplit(url)
    numbers = itertools.count()
    started = time.monotonic()

    async def client() -> None:
        reader = writer = None
        while True:
            index = next(numbers)
            if index >= requests or time.monotonic() - started > time_limit_s:
                break
            payload = request_bytes(method, url, body(index) if callable(body) else body, headers)
            report.sent += 1
            sent_at = time.monotonic()
            try:
                if writer is None:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(parts.hostname, parts.port), request_timeout_s)
                writer.write(payload)
                reply = await asyncio.wait_for(read_reply(reader), request_timeout_s - (time.monotonic() - sent_at))
            except Exception as err:  # every way a request can fail is counted by kind
                report.failures[_failure_kind(err)] += 1
                writer = _close(writer)
                continue
            report.statuses[reply.status] += 1
            report.latencies_s.setdefault(reply.status, []).append(time.monotonic() - sent_at)
            if reply.status in (429, 503) and "retry-after" not in reply.headers:
                report.missing_retry_after += 1
            if not reply.keep_alive:
                writer = _close(writer)
        _close(writer)

    await asyncio.gather(*(client() for _ in range(clients)))
    report.wall_s = time.monotonic() - started
    return report


def _failure_kind(err: BaseException) -> str:
    if isinstance(err, (asyncio.TimeoutError, TimeoutError)):
        return "timeout"
    if isinstance(err, ConnectionRefusedError):
        return "refused"
    if isinstance(err, (ConnectionResetError, BrokenPipeError)):
        return "reset"
    if isinstance(err, (asyncio.IncompleteReadError, asyncio.LimitOverrunError)):
        return "closed"
    return type(err).__name__


def _close(writer: asyncio.StreamWriter | None) -> None:
    if writer is not None:
        writer.close()
    return None


@dataclass
class SlowLorisReport:
    opened: int = 0
    refused: int = 0
    closed_by_server: int = 0
    bytes_sent: int = 0
    closed_after_s: list[float] = field(default_factory=list)


class SlowLoris:
    """`connections` connections to `host:port`, each sending the headers of a request that never ends, one
    byte per `interval_s`, for `duration_s` (then all are closed). Runs on a thread of its own from `start()`;
    `stop()` ends it early and returns the report."""

    def __init__(self, host: str, port: int, connections: int, interval_s: float = 1.0, duration_s: float = 10.0):
        self.host, self.port, self.connections = host, port, connections
        self.interval_s, self.duration_s = interval_s, duration_s
        self.report = SlowLorisReport()
        self._stop = threading.Event()
        self._all_open = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self, wait_open_s: float = 30.0) -> SlowLoris:
        """Start, and return once every connection was tried (or `wait_open_s` passed)."""
        self._thread.start()
        self._all_open.wait(wait_open_s)
        return self

    def stop(self) -> SlowLorisReport:
        self._stop.set()
        self._thread.join(self.duration_s + 30)
        return self.report

    async def _run(self) -> None:
        ends = time.monotonic() + self.duration_s
        text = b"POST /run_code HTTP/1.1\r\nHost: slow\r\nX-Slow: " + b"a" * int(self.duration_s / self.interval_s + 64)
        tasks = []
        for _ in range(self.connections):
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
            except OSError:
                self.report.refused += 1
                continue
            self.report.opened += 1
            tasks.append(asyncio.create_task(self._trickle(reader, writer, text, ends)))
        self._all_open.set()
        await asyncio.gather(*tasks)

    async def _trickle(self, reader, writer, text: bytes, ends: float) -> None:
        opened = time.monotonic()
        closed = asyncio.create_task(reader.read(1))  # b"" (or an error) once the server closes
        try:
            for byte in text:
                if self._stop.is_set() or time.monotonic() > ends:
                    return
                writer.write(bytes([byte]))
                self.report.bytes_sent += 1
                done, _ = await asyncio.wait({closed}, timeout=self.interval_s)
                if done:
                    self.report.closed_by_server += 1
                    self.report.closed_after_s.append(time.monotonic() - opened)
                    return
        except OSError:
            self.report.closed_by_server += 1
            self.report.closed_after_s.append(time.monotonic() - opened)
        finally:
            closed.cancel()
            writer.close()


@dataclass
class UploadReport:
    status: int | None
    body: bytes
    bytes_sent: int
    elapsed_s: float
    error: str | None = None


def upload(url: str, total_bytes: int, chunk_bytes: int = 1 << 20, headers: dict[str, str] | None = None,
           declare_length: bool = True, timeout_s: float = 60.0) -> UploadReport:
    """POST `total_bytes` (generated chunk by chunk, never held whole) to `url`, declared in Content-Length or
    sent chunked; stops sending as soon as the server replies or closes, then reads its reply."""
    parts = urlsplit(url)
    started = time.monotonic()
    sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout_s)
    framing = {"Content-Length": str(total_bytes)} if declare_length else {"Transfer-Encoding": "chunked"}
    head = [f"POST {parts.path} HTTP/1.1", f"Host: {parts.netloc}", "Content-Type: application/json",
            *(f"{k}: {v}" for k, v in {**framing, **(headers or {})}.items())]
    sent, error = 0, None
    try:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        for chunk in _chunks(total_bytes, chunk_bytes):
            if select.select([sock], [], [], 0)[0] or time.monotonic() - started > timeout_s:
                break  # the server answered (or closed) already
            sock.sendall(chunk if declare_length else b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
        else:
            if not declare_length:
                sock.sendall(b"0\r\n\r\n")
    except OSError as err:  # the server closed while we were sending: its reply may still be there to read
        error = f"{type(err).__name__}: {err}"
    status, body = _read_blocking_reply(sock, started + timeout_s)
    sock.close()
    return UploadReport(status, body, sent, time.monotonic() - started, error)


def _chunks(total: int, size: int) -> Iterator[bytes]:
    block = b"x" * size
    for start in range(0, total, size):
        yield block[:min(size, total - start)]


def _read_blocking_reply(sock: socket.socket, deadline: float) -> tuple[int | None, bytes]:
    data = b""
    try:
        while b"\r\n\r\n" not in data or len(data) < _expected_length(data):
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    if not data.startswith(b"HTTP/"):
        return None, data
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def _expected_length(data: bytes) -> int:
    head, _, _ = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    return sys.maxsize


class MemorySampler:
    """Peak resident memory (bytes) of process `pid`, and of it with its children, sampled every `interval_s`
    on a thread from `start()` until `stop()`."""

    def __init__(self, pid: int, interval_s: float = 0.05):
        self.process = psutil.Process(pid)
        self.interval_s = interval_s
        self.start_rss = self.peak_rss = self.peak_tree_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def start(self) -> MemorySampler:
        self.start_rss = self._rss(self.process)
        self._thread.start()
        return self

    def stop(self) -> MemorySampler:
        self._stop.set()
        self._thread.join(5)
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                own = self._rss(self.process)
                tree = own + sum(self._rss(child) for child in self.process.children(recursive=True))
            except psutil.Error:
                return
            self.peak_rss, self.peak_tree_rss = max(self.peak_rss, own), max(self.peak_tree_rss, tree)
            self._stop.wait(self.interval_s)

    @staticmethod
    def _rss(process: psutil.Process) -> int:
        try:
            return process.memory_info().rss
        except psutil.Error:
            return 0


def service_command(*args: str) -> list[str]:
    """`python -m rl360.cli serve ARGS...` with this interpreter."""
    return [sys.executable, "-m", "rl360.cli", "serve", *args]


def environment(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}
