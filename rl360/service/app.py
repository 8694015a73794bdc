"""The one layer under every rl360 HTTP service: a FastAPI app behind a guard, served by uvicorn.

A service builds its routes on `service_app(error_format)`, wraps the app in a `ServiceGuard` with its
`ServiceLimits` and key, and calls `run_service`. Every service then has:

- **Keys.** With a key (`--api-key-env VAR`: the variable's name; the key stays in the environment), every
  route but `/health` needs `Authorization: Bearer <key>`. Anything else gets 401 before its body is read
  and before any handler runs. Keys are compared as SHA-256 digests with `hmac.compare_digest` (constant
  time; the length is not leaked either) and never printed, logged or put in a reply.
  A service for browsers (`browser_login`) also lets a page in: `GET <any path>?key=<key>` answers 303 to the
  same path without the key and sets a session cookie (`rl360_session`, HttpOnly, SameSite=Strict: an HMAC
  of the key, not the key), which then stands for the header; a wrong key there gets 401.
- **Limits.** At most `max_in_flight` requests are admitted at once; one more gets 429 with `Retry-After`
  at once (no queue without a bound). A body over `max_body_bytes` gets 413: at once when Content-Length
  says so, else as soon as the bytes read pass the limit; the connection is then closed, so the rest of a
  huge upload is never read. Headers must arrive within `read_timeout_s` of the connection's opening (or of
  the previous reply on it: idle kept-alive connections close then too) or the connection is dropped, and
  an admitted body within `read_timeout_s` or the reply is 408 (slow-loris senders hold a socket, never a
  request slot). At most `max_connections`
  connections are open; further ones are closed at once.
- **Deadlines.** An admitted request has `request_timeout_s` from its arrival; past it its handler is
  cancelled and the reply is 504 (mid-stream: a last server-sent `event: error`). A client that hangs up
  has its handler cancelled too, so work still queued for it never runs.
- **Graceful shutdown** on SIGTERM or SIGINT: stop accepting, answer 503 (`Retry-After`) to requests that
  arrive on open connections, let admitted ones finish until `shutdown_grace_s` minus a margin
  (`cancel_margin_s`), then cancel them with 503 "cancelled: service shutting down", run the app's
  shutdown (e.g. stop worker processes) and exit, all within the grace period.
- **`/health`** (no key: 200 `{"status": "ok"}`, 503 `{"status": "draining"}` while shutting down) and
  **`/metrics`** (key required when there is one; Prometheus text format): `rl360_http_requests_total`
  by route, method and status, the latency histogram `rl360_http_request_duration_seconds`,
  `rl360_http_requests_in_flight`, `rl360_http_connections_open`, `rl360_http_request_errors_total` by
  kind, and the service's own metrics.
- **Replies** in JSON, or as server-sent events (`event_stream`); errors in the service's own shape
  (`error_format`), naming the field at fault where there is one (`json_object` does that for bodies:
  malformed JSON, a non-object, unknown fields).

Memory held for requests is bounded by about `max_connections` x 80 KiB (h11's 16 KiB header limit plus
uvicorn's 64 KiB read-ahead of a body, after which it stops reading the socket) plus `max_in_flight` x
`max_body_bytes` (bodies of admitted requests), on top of the service's own.

Cancelling a handler cancels what it awaits: work still queued (a sandbox run waiting for a worker, a
generation waiting for its batch) is dropped; work already running in another process or thread goes on until
it ends or the process exits (a model's batcher stops decoding the rows of a cancelled request).

Error kinds counted: bad_request, unauthorized, not_found, method_not_allowed, read_timeout (408),
body_too_large (413), overloaded (429), draining (503 while shutting down), shutdown_cancelled (503,
admitted and cancelled by the shutdown), deadline (504), internal (500), client_disconnect,
too_many_connections, header_timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import resource
import socket
import sys
import time
import urllib.parse
from collections.abc import AsyncIterable, Callable, Collection, Mapping
from contextlib import suppress
from dataclasses import dataclass, fields
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from rl360.errors import UserError
from rl360.service.metrics import MetricsRegistry

logger = logging.getLogger("rl360.serve")

MIN_KEY_CHARS = 16
SESSION_COOKIE = "rl360_session"
_SMALL_BODY_BYTES = 64 << 10  # a rejected request with a body up to this stays on a kept-alive connection
_STATUS_KINDS = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
                 408: "read_timeout", 413: "body_too_large", 422: "bad_request", 429: "overloaded",
                 503: "unavailable", 504: "deadline"}


@dataclass(frozen=True)
class ServiceLimits:
    """How much one service takes on; see the module docstring for what each bound does."""

    max_body_bytes: int = 16 << 20
    max_in_flight: int = 64
    request_timeout_s: float = 600.0
    read_timeout_s: float = 30.0
    shutdown_grace_s: float = 30.0
    max_connections: int = 1024
    retry_after_s: int = 1

    def __post_init__(self):
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"ServiceLimits.{item.name} must be a positive number, got {value!r}")

    @property
    def cancel_margin_s(self) -> float:
        """Before the end of the grace period, in-flight requests are cancelled this much early."""
        return min(1.0, self.shutdown_grace_s / 4)


class ServiceError(Exception):
    """A request answered with `status` and the service's error body; `param` names the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param
        self.kind = kind or error_kind(status)


def error_kind(status: int) -> str:
    """The metrics kind of an error status."""
    return _STATUS_KINDS.get(status, "internal" if status >= 500 else "bad_request")


ErrorFormat = Callable[[ServiceError], dict]


def detail_error(error: ServiceError) -> dict:
    """FastAPI's own error shape: `{"detail": message}`."""
    return {"detail": str(error)}


def service_app(error_format: ErrorFormat = detail_error, lifespan: Any = None) -> FastAPI:
    """A FastAPI app whose every error (404, 405, `ServiceError`, validation, a handler's crash) is in
    `error_format`'s shape. No docs or schema routes: the surface is only the service's own routes."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    async def service_error(request: Request, error: ServiceError) -> JSONResponse:
        return JSONResponse(error_format(error), status_code=error.status)

    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        if error.status_code == 404:
            problem = ServiceError(404, f"no route {request.url.path}")
        elif error.status_code == 405:
            problem = ServiceError(405, f"{request.method} is not allowed on {request.url.path}")
        else:
            problem = ServiceError(error.status_code, str(error.detail))
        return JSONResponse(error_format(problem), status_code=problem.status, headers=error.headers)

    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        first = (error.errors() or [{}])[0]
        field = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        problem = ServiceError(400, f"{field or 'request'}: {first.get('msg', 'invalid')}", field)
        return JSONResponse(error_format(problem), status_code=400)

    async def crash(request: Request, error: Exception) -> JSONResponse:
        problem = ServiceError(500, f"internal error ({type(error).__name__}); the service's log has the details")
        return JSONResponse(error_format(problem), status_code=500)

    app.add_exception_handler(ServiceError, service_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, crash)
    return app


def number_field(data: dict, key: str, default: float, low: float, high: float, *, integer: bool = False,
                 low_open: bool = False, where: str = "", error: type[ServiceError] = ServiceError) -> float:
    """`data[key]` checked to be a number (an int with `integer`) in [low, high] (`(low, high]` with
    `low_open`), or `default` when absent or null; else `error(400)` naming the field (`where.key`)."""
    name = f"{where}.{key}" if where else key
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise error(400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}", name)
    if not (low < value if low_open else low <= value) or value > high:
        raise error(400, f"'{name}' must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value!r}", name)
    return value


def json_object(body: bytes, allowed: Collection[str] | None) -> dict:
    """The JSON object in `body`; `ServiceError(400)` saying where the JSON breaks, that it is not an
    object, or which key is not one of `allowed` (named in `param`; None: any key)."""
    try:
        data = json.loads(body)
    except UnicodeDecodeError as err:
        raise ServiceError(400, f"body is not UTF-8 text (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise ServiceError(400, f"body is not JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    except RecursionError:
        raise ServiceError(400, "body is JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise ServiceError(400, f"body must be a JSON object, got {type(data).__name__}")
    unknown = [] if allowed is None else [key for key in data if key not in allowed]
    if unknown:
        raise ServiceError(400, f"unknown field {unknown[0]!r} (accepted: {', '.join(sorted(allowed))})", unknown[0])
    return data


def sse_event(data: Any, event: str | None = None) -> bytes:
    """One server-sent event: `data` as JSON (a string as it is), under an `event:` name if given."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    lines = ([f"event: {event}"] if event else []) + [f"data: {line}" for line in text.split("\n")]
    return ("\n".join(lines) + "\n\n").encode()


def event_stream(events: AsyncIterable[Any], done: str | None = "[DONE]") -> StreamingResponse:
    """A reply streaming each of `events` as a server-sent event, then `data: <done>` (OpenAI's `[DONE]`)."""

    async def body():
        async for event in events:
            yield sse_event(event)
        if done is not None:
            yield sse_event(done)

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


class _Reply:
    """The ASGI `send` of one request, remembering what went out."""

    def __init__(self, send: Callable, guard: ServiceGuard):
        self._send, self._guard = send, guard
        self.status: int | None = None
        self.started = self.complete = self.sse = False
        self.error_kind: str | None = None

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            if self._guard.draining and not any(name.lower() == b"connection" for name, _ in headers):
                message = {**message, "headers": headers + [(b"connection", b"close")]}
            self.status, self.started = message["status"], True
            self.sse = any(name.lower() == b"content-type" and value.startswith(b"text/event-stream")
                           for name, value in headers)
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)


class ServiceGuard:
    """The ASGI app uvicorn runs: keys, limits, deadlines, draining and metrics around `app`."""

    def __init__(self, name: str, app: Any, limits: ServiceLimits, api_key: str | None = None,
                 error_format: ErrorFormat = detail_error, registry: MetricsRegistry | None = None,
                 open_paths: Collection[str] = ("/health",), browser_login: bool = False):
        self.name, self.app, self.limits, self.error_format = name, app, limits, error_format
        self.open_paths = frozenset(open_paths)
        self._key_digest = hashlib.sha256(api_key.encode()).digest() if api_key else None
        self.browser_login = browser_login
        self._session = None  # the cookie value standing for the key (browser_login)
        if browser_login and self._key_digest is not None:
            self._session = hmac.new(self._key_digest, b"rl360 browser session", hashlib.sha256).hexdigest()
        self.registry = registry or MetricsRegistry()
        self.requests = self.registry.counter("rl360_http_requests_total", "Requests answered, by route, method "
                                              "and status (none: the client left first).",
                                              ["service", "route", "method", "status"])
        self.latency = self.registry.histogram("rl360_http_request_duration_seconds", "Seconds from a request's "
                                               "headers to the end of its reply.", ["service", "route"])
        self.in_flight_gauge = self.registry.gauge("rl360_http_requests_in_flight", "Requests admitted and not "
                                                   "yet answered.", ["service"])
        self.connections_gauge = self.registry.gauge("rl360_http_connections_open", "Open client connections.",
                                                     ["service"])
        self.errors = self.registry.counter("rl360_http_request_errors_total", "Requests or connections that "
                                            "ended in an error, by kind.", ["service", "kind"])
        self.in_flight_gauge.set(0, service=name)
        self.connections_gauge.set(0, service=name)
        self.in_flight = 0
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stoppers: set[Callable[[str], None]] = set()
        self._cancelling = False
        self._route_paths: frozenset[str] | None = None

    # ---- the ASGI entry point ----
    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                self.loop = asyncio.get_running_loop()
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        path = scope["path"].rstrip("/") or "/"
        scope["path"] = path
        reply = _Reply(send, self)
        try:
            await self._handle(scope, receive, reply, path, started)
        finally:
            route = path if path in self._routes() else "other"
            status = str(reply.status) if reply.status is not None else "none"
            self.requests.inc(service=self.name, route=route, method=scope["method"], status=status)
            self.latency.observe(time.monotonic() - started, service=self.name, route=route)
            kind = reply.error_kind or (error_kind(reply.status) if reply.status and reply.status >= 400 else None)
            if kind:
                self.errors.inc(service=self.name, kind=kind)

    async def _handle(self, scope: dict, receive: Callable, reply: _Reply, path: str, started: float) -> None:
        method = scope["method"]
        headers = {name.lower(): value for name, value in scope["headers"]}
        if path == "/health" and method in ("GET", "HEAD"):
            await _send_json(reply, 503 if self.draining else 200, {"status": "draining" if self.draining else "ok"})
            return
        query = scope.get("query_string", b"")
        if self._session is not None and method == "GET" and any(p.partition(b"=")[0] == b"key"
                                                                 for p in query.split(b"&")):
            await self._login(reply, path, query, headers)
            return
        if path not in self.open_paths and not (self.authorized(headers.get(b"authorization"))
                                                or self._session_cookie(headers.get(b"cookie"))):
            await self._error(reply, ServiceError(401, "missing or wrong API key (send 'Authorization: Bearer "
                                                       "<key>')"), headers, [(b"www-authenticate", b"Bearer")])
            return
        if path == "/metrics" and method == "GET":
            await _send(reply, 200, self.registry.render().encode(), "text/plain; version=0.0.4; charset=utf-8")
            return
        if self.draining:
            await self._error(reply, ServiceError(503, "service is shutting down; retry after it restarts",
                                                  kind="draining"), headers, self._retry_after(), close=True)
            return
        try:
            length = _declared_length(headers)
        except ValueError as err:
            await self._error(reply, ServiceError(400, str(err), "Content-Length"), headers, close=True)
            return
        if length is not None and length > self.limits.max_body_bytes:
            await self._error(reply, ServiceError(413, f"body of {length} bytes is over this service's limit of "
                                                       f"{self.limits.max_body_bytes} bytes"), headers, close=True)
            return
        if self.in_flight >= self.limits.max_in_flight:
            await self._error(reply, ServiceError(429, f"{self.in_flight} requests in flight, the most this service "
                                                       f"takes; retry after {self.limits.retry_after_s} s"),
                              headers, self._retry_after())
            return
        self.in_flight += 1
        self.in_flight_gauge.set(self.in_flight, service=self.name)
        try:
            await self._run_admitted(scope, receive, reply, started)
        finally:
            self.in_flight -= 1
            self.in_flight_gauge.set(self.in_flight, service=self.name)

    async def _run_admitted(self, scope: dict, receive: Callable, reply: _Reply, started: float) -> None:
        """Read the body, run the app, and end the request at whichever comes first: the app's reply, the
        read timeout (408), the deadline (504), the shutdown's cancel (503) or the client leaving."""
        loop = asyncio.get_running_loop()
        stop: asyncio.Future = loop.create_future()

        def stop_with(reason: str) -> None:
            if not stop.done():
                stop.set_result(reason)

        gone = asyncio.Event()
        watchers: list[asyncio.Task] = []
        read_timer = loop.call_later(self.limits.read_timeout_s, stop_with, "read_timeout")

        async def work() -> None:
            body = await _read_body(receive, self.limits.max_body_bytes)
            read_timer.cancel()
            watchers.append(asyncio.create_task(_watch_disconnect(receive, gone, reply, stop_with)))
            await self.app(scope, _replay(body, gone), reply.send)

        task = asyncio.create_task(work())
        task.add_done_callback(lambda _: stop_with("done"))
        deadline_timer = loop.call_later(max(0.0, started + self.limits.request_timeout_s - time.monotonic()),
                                         stop_with, "deadline")
        self._stoppers.add(stop_with)
        if self._cancelling:
            stop_with("shutdown")
        try:
            reason = await stop
            if task.done():  # it ended by itself just as a timer fired: its own outcome stands
                reason = "done"
        finally:
            read_timer.cancel()
            deadline_timer.cancel()
            self._stoppers.discard(stop_with)
            for watcher in watchers:
                watcher.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait({task})
        await self._conclude(reason, task, reply, scope)

    async def _conclude(self, reason: str, task: asyncio.Task, reply: _Reply, scope: dict) -> None:
        if reason == "done" and not task.cancelled():
            error = task.exception()
            if isinstance(error, _BodyTooLarge):
                await self._error(reply, ServiceError(413, "body is over this service's limit of "
                                                           f"{self.limits.max_body_bytes} bytes"), {}, close=True)
            elif isinstance(error, _ClientGone):
                reply.error_kind = "client_disconnect"
            elif error is not None:
                logger.error("%s %s failed", scope["method"], scope["path"], exc_info=error)
                if not reply.started:
                    await self._error(reply, ServiceError(500, f"internal error ({type(error).__name__}); the "
                                                               "service's log has the details"), {}, close=True)
                else:
                    reply.error_kind = "internal"
            return
        if reason == "disconnect":
            reply.error_kind = "client_disconnect"
            return
        problem = {
            "read_timeout": ServiceError(408, f"request body did not arrive within {self.limits.read_timeout_s:g} s"),
            "deadline": ServiceError(504, f"request passed this service's deadline of "
                                          f"{self.limits.request_timeout_s:g} s and was cancelled"),
            "shutdown": ServiceError(503, "cancelled: service shutting down", kind="shutdown_cancelled"),
        }.get(reason, ServiceError(500, "request ended unexpectedly"))
        if not reply.started:
            await self._error(reply, problem, {}, self._retry_after() if problem.status == 503 else [],
                              close=problem.status != 504)
        elif reply.sse and not reply.complete:
            reply.error_kind = problem.kind
            await reply.send({"type": "http.response.body", "more_body": False,
                              "body": sse_event({**self.error_format(problem), "status": problem.status}, "error")})
        else:
            reply.error_kind = problem.kind  # a half-sent plain reply: uvicorn closes the connection

    # ---- helpers ----
    @property
    def requires_key(self) -> bool:
        """Whether every route but the open ones needs the API key."""
        return self._key_digest is not None

    def authorized(self, header: bytes | None) -> bool:
        """Whether `header` (the Authorization value) carries this service's key; always True without one."""
        if self._key_digest is None:
            return True
        scheme, _, token = (header or b"").partition(b" ")
        if scheme.lower() != b"bearer":
            token = b""
        return hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self._key_digest)

    def _session_cookie(self, header: bytes | None) -> bool:
        """Whether the Cookie header carries the browser session (`browser_login` only)."""
        if self._session is None or not header:
            return False
        for part in header.split(b";"):
            name, _, value = part.strip().partition(b"=")
            if name == SESSION_COOKIE.encode() and hmac.compare_digest(value, self._session.encode()):
                return True
        return False

    async def _login(self, reply: _Reply, path: str, query: bytes, headers: Mapping[bytes, bytes]) -> None:
        """`?key=` from a browser: 303 to the same address without it, setting the session cookie."""
        pairs = urllib.parse.parse_qsl(query.decode("latin-1"), keep_blank_values=True)
        given = next((value for name, value in pairs if name == "key"), None)
        if given is None or not self.authorized(b"Bearer " + given.encode()):
            await self._error(reply, ServiceError(401, "wrong key in ?key="), headers)
            return
        rest = urllib.parse.urlencode([(name, value) for name, value in pairs if name != "key"])
        location = path + (f"?{rest}" if rest else "")
        cookie = f"{SESSION_COOKIE}={self._session}; Path=/; HttpOnly; SameSite=Strict"
        await _send(reply, 303, b"", "text/plain", [(b"location", location.encode()),
                                                     (b"set-cookie", cookie.encode())])

    async def _error(self, reply: _Reply, error: ServiceError, headers: Mapping[bytes, bytes],
                     extra: list[tuple[bytes, bytes]] | None = None, close: bool = False) -> None:
        reply.error_kind = error.kind
        if not close:
            length = headers.get(b"content-length")
            close = b"chunked" in headers.get(b"transfer-encoding", b"").lower() or (
                length is not None and length.isdigit() and int(length) > _SMALL_BODY_BYTES)
        extra = list(extra or []) + ([(b"connection", b"close")] if close else [])
        await _send(reply, error.status, json.dumps(self.error_format(error)).encode(), "application/json", extra)

    def _retry_after(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", str(self.limits.retry_after_s).encode())]

    def _routes(self) -> frozenset[str]:
        if self._route_paths is None:
            paths = {getattr(route, "path", None) for route in getattr(self.app, "routes", [])}
            self._route_paths = frozenset(p for p in paths if p) | {"/health", "/metrics"}
        return self._route_paths

    # ---- shutdown ----
    def begin_drain(self) -> None:
        """Start the graceful shutdown (safe to call from a signal handler on the loop's thread)."""
        if self.draining:
            return
        self.draining = True
        cancel_after = self.limits.shutdown_grace_s - self.limits.cancel_margin_s
        print(f"rl360 {self.name}: shutting down: {self.in_flight} request(s) in flight, cancelled if not done "
              f"in {cancel_after:g} s", file=sys.stderr, flush=True)
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.call_later, cancel_after, self.cancel_in_flight)

    def cancel_in_flight(self) -> None:
        """End every admitted request now with 503 "cancelled: service shutting down"."""
        self._cancelling = True
        for stop_with in list(self._stoppers):
            stop_with("shutdown")

    # ---- connections (called by the protocol) ----
    def connection_opened(self, open_now: int) -> bool:
        """Count a new connection; False when it is one over `max_connections` (it is then closed)."""
        self.connections_gauge.set(open_now, service=self.name)
        if open_now > self.limits.max_connections:
            self.errors.inc(service=self.name, kind="too_many_connections")
            return False
        return True

    def connection_closed(self, open_now: int) -> None:
        self.connections_gauge.set(open_now, service=self.name)


async def _read_body(receive: Callable, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge()
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _watch_disconnect(receive: Callable, gone: asyncio.Event, reply: _Reply,
                            stop_with: Callable[[str], None]) -> None:
    """Wait for the client to hang up (uvicorn also says so once the reply is complete)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
            if not reply.complete:
                stop_with("disconnect")
            return


def _replay(body: bytes, gone: asyncio.Event) -> Callable:
    """An ASGI `receive` giving the app the body already read, then `http.disconnect` when the client leaves."""
    given = False

    async def receive() -> dict:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    return receive


def _declared_length(headers: Mapping[bytes, bytes]) -> int | None:
    value = headers.get(b"content-length")
    if value is None:
        return None
    if not value.strip().isdigit():
        raise ValueError(f"Content-Length must be a non-negative integer, got {value[:40]!r}")
    return int(value)


async def _send(reply: _Reply, status: int, body: bytes, content_type: str,
                extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    await reply.send({"type": "http.response.start", "status": status, "headers": headers + list(extra or [])})
    await reply.send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_json(reply: _Reply, status: int, body: dict) -> None:
    await _send(reply, status, json.dumps(body).encode(), "application/json")


class _ConnectionGuard:
    """Mixed into uvicorn's h11 protocol (`H11Protocol`, whose hooks it uses: connection_made/lost,
    on_response_complete, cycle, timeout_keep_alive_handler): a connection cap and a deadline for each
    request's headers. h11 (pure Python) needs no extra dependency; httptools measured no steady gain on the
    2-core test machine, where the load generator sharing the cores was the bound."""

    guard: ServiceGuard

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        if not self.guard.connection_opened(len(self.connections)):
            transport.close()
            return
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)
        self.guard.connection_closed(len(self.connections))

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def _arm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.guard.limits.read_timeout_s, self._header_deadline, self.cycle)

    def _header_deadline(self, cycle_when_armed: Any) -> None:
        """No new request's headers arrived in time: drop the connection (a request being served is kept)."""
        self._header_timer = None
        idle = self.cycle is None or self.cycle.response_complete
        if self.cycle is cycle_when_armed and idle and not self.transport.is_closing():
            self.guard.errors.inc(service=self.guard.name, kind="header_timeout")
            self.timeout_keep_alive_handler()


class _GracefulServer(uvicorn.Server):
    """uvicorn's server that tells the guard to drain when SIGTERM or SIGINT arrives."""

    def __init__(self, config: uvicorn.Config, guard: ServiceGuard):
        super().__init__(config)
        self.guard = guard

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.guard.begin_drain()
        super().handle_exit(sig, frame)


KEY_NOTE = " (API key required)"
BROWSER_KEY_NOTE = " (API key required: open {url}/?key=<key> once, or send 'Authorization: Bearer <key>')"


def run_service(guard: ServiceGuard, host: str, port: int, banner: str, access_log: bool = False) -> int:
    """Bind `host:port` (port 0: any free one), print `banner` with `{url}` filled in (and, when the guard holds a
    key, how to send it), then serve until SIGTERM/SIGINT and a graceful shutdown. uvicorn's own log goes to stderr
    (warnings only unless `access_log`, which adds one line per request: method, path, status; never headers)."""
    sock = bind_socket(host, port)
    _raise_open_files_limit(guard.limits.max_connections + 256)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    protocol = type("GuardedH11Protocol", (_ConnectionGuard, H11Protocol), {"guard": guard})
    limits = guard.limits
    config = uvicorn.Config(guard, http=protocol, ws="none", lifespan="on", interface="asgi3",
                            log_level="info" if access_log else "warning", access_log=access_log,
                            timeout_keep_alive=limits.read_timeout_s, server_header=False, proxy_headers=False,
                            timeout_graceful_shutdown=max(0.1, limits.shutdown_grace_s - limits.cancel_margin_s / 2))
    print(service_banner(guard, banner).format(url=f"http://{shown}:{bound_port}"), flush=True)
    _GracefulServer(config, guard).run(sockets=[sock])
    return 0


def service_banner(guard: ServiceGuard, banner: str) -> str:
    """`banner`, and when `guard` holds a key, how clients (or a browser, for `browser_login`) send it."""
    if not guard.requires_key:
        return banner
    return banner + (BROWSER_KEY_NOTE if guard.browser_login else KEY_NOTE)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host:port`; SystemExit naming the address when it cannot be bound."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as err:
        raise SystemExit(f"cannot listen on {host}:{port}: {err}") from None
    sock.set_inheritable(True)
    return sock


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def service_options(args: argparse.Namespace, service: str, exposure: str,
                    command: str = "") -> tuple[str | None, ServiceLimits]:
    """The API key and limits a service's options (`add_service_arguments`) give, refusing (`UserError`) a
    non-loopback `--host` without a key (`require_key_off_loopback`, with `service`, `exposure`, `command`)."""
    api_key = api_key_from_env(args.api_key_env)
    limits = limits_from_args(args)
    require_key_off_loopback(service, args.host, api_key, exposure, command)
    return api_key, limits


def require_key_off_loopback(service: str, host: str, api_key: str | None, exposure: str,
                             command: str = "") -> None:
    """Refuse (`UserError`) to serve `service` on a non-loopback `host` without an API key; `exposure` says what
    anyone who reaches it could then do. Every `rl360 serve` service (and `rl360 view`: `command`, the command
    named in the message, default `serve <service>`) makes this check before it starts."""
    if api_key is None and not is_loopback(host):
        raise UserError(f"{command or f'serve {service}'}: refusing to listen on {host} without a key: {exposure}. "
                        "Pass --api-key-env VAR (clients send 'Authorization: Bearer <key>'), or listen on 127.0.0.1 "
                        "and tunnel to it.")


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0..65535 (0: any free one)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number 0..65535, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535 (0: any free port), got {port}")
    return port


def api_key_from_env(variable: str) -> str | None:
    """The key in environment variable `variable` (None when `variable` is empty); SystemExit when it is
    unset or too short. The message names the variable, never its value."""
    if not variable:
        return None
    key = os.environ.get(variable, "").strip()
    if not key:
        raise SystemExit(f"--api-key-env {variable}: that environment variable is not set or is empty")
    if len(key) < MIN_KEY_CHARS:
        raise SystemExit(f"--api-key-env {variable}: the key is shorter than {MIN_KEY_CHARS} characters; make one "
                         "with: python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    return key


def add_service_arguments(parser: argparse.ArgumentParser, port: int, defaults: ServiceLimits) -> None:
    """The options every `rl360 serve` service takes (address, key, limits, shutdown)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=port_number, default=port, help="port (0: any free port, printed at start)")
    parser.add_argument("--api-key-env", default="", metavar="VAR",
                        help="require 'Authorization: Bearer $VAR' on every route but /health (the variable's "
                             "name; the key is read from the environment and never printed)")
    parser.add_argument("--max-in-flight", type=int, default=defaults.max_in_flight,
                        help="requests admitted at once; more get 429 with Retry-After")
    parser.add_argument("--request-timeout", type=float, default=defaults.request_timeout_s, metavar="SECONDS",
                        help="deadline of each request from its arrival (504 past it)")
    parser.add_argument("--read-timeout", type=float, default=defaults.read_timeout_s, metavar="SECONDS",
                        help="time a client has to send a request's headers, and then its body")
    parser.add_argument("--shutdown-grace", type=float, default=defaults.shutdown_grace_s, metavar="SECONDS",
                        help="on SIGTERM, in-flight requests finish or are cancelled (503) and the process exits "
                             "within this")
    parser.add_argument("--max-body-mb", type=float, default=defaults.max_body_bytes / (1 << 20),
                        help="largest request body in MiB (413 beyond it)")
    parser.add_argument("--max-connections", type=int, default=defaults.max_connections,
                        help="open client connections at most")
    parser.add_argument("--access-log", action="store_true", help="log one line per request to stderr")


def limits_from_args(args: argparse.Namespace) -> ServiceLimits:
    """`ServiceLimits` from the options of `add_service_arguments`; SystemExit naming a bad option."""
    try:
        return ServiceLimits(max_body_bytes=int(args.max_body_mb * (1 << 20)), max_in_flight=args.max_in_flight,
                             request_timeout_s=args.request_timeout, read_timeout_s=args.read_timeout,
                             shutdown_grace_s=args.shutdown_grace, max_connections=args.max_connections)
    except ValueError as err:
        raise SystemExit(f"rl360 serve: {err}") from None


def _raise_open_files_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
