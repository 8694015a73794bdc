"""A small service on rl360's service layer, run as a process by tests/test_service_layer.py:

    python -m tests.serve_layer_app [service options: --port, --api-key-env, --max-in-flight, ...]

Routes: `POST /work {"seconds": number >= 0, "tag": str, "hold": bool}` sleeps that long (cancellable) and
answers `{"tag": ...}`; with `"hold": true` it first waits until the process gets SIGUSR1, which releases every
request held so far; `POST /stream {"events": int, "interval_s": number}` answers server-sent events
`{"i": 0}`, `{"i": 1}`, ... then `[DONE]`. `rl360_test_work_started_total` counts /work handlers that
started and `rl360_test_work_cancelled_total` those cancelled before finishing.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from contextlib import asynccontextmanager

from fastapi import Request

from rl360.service.app import (
    ServiceError,
    ServiceGuard,
    ServiceLimits,
    add_service_arguments,
    api_key_from_env,
    event_stream,
    json_object,
    limits_from_args,
    run_service,
    service_app,
)
from rl360.service.metrics import MetricsRegistry

DEFAULTS = ServiceLimits(max_body_bytes=1 << 20, max_in_flight=4, request_timeout_s=3.0, read_timeout_s=2.0,
                         shutdown_grace_s=3.0)


def _number(data: dict, key: str, default: float) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ServiceError(400, f"'{key}' must be a number >= 0, got {value!r}", key)
    return float(value)


def build(limits: ServiceLimits, api_key: str | None) -> ServiceGuard:
    registry = MetricsRegistry()
    started = registry.counter("rl360_test_work_started_total", "Work handlers started.")
    cancelled = registry.counter("rl360_test_work_cancelled_total", "Work handlers cancelled before the end.")
    gates: list[asyncio.Event] = []  # the gate held requests wait on; SIGUSR1 opens it and starts a new one

    def release() -> None:
        gates.pop().set()
        gates.append(asyncio.Event())

    @asynccontextmanager
    async def lifespan(_app):
        gates.append(asyncio.Event())
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, release)
        yield

    app = service_app(lifespan=lifespan)

    async def work(request: Request) -> dict:
        data = json_object(await request.body(), {"seconds", "tag", "hold"})
        seconds = _number(data, "seconds", 0.0)
        tag, hold = data.get("tag", ""), data.get("hold", False)
        if not isinstance(tag, str):
            raise ServiceError(400, f"'tag' must be a string, got {type(tag).__name__}", "tag")
        if not isinstance(hold, bool):
            raise ServiceError(400, f"'hold' must be true or false, got {hold!r}", "hold")
        started.inc()
        try:
            if hold:
                await gates[-1].wait()
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            cancelled.inc()
            raise
        return {"tag": tag}

    async def stream(request: Request):
        data = json_object(await request.body(), {"events", "interval_s"})
        events = data.get("events", 3)
        if isinstance(events, bool) or not isinstance(events, int) or events < 0:
            raise ServiceError(400, f"'events' must be an integer >= 0, got {events!r}", "events")
        interval = _number(data, "interval_s", 0.0)

        async def numbered():
            for i in range(events):
                if i:
                    await asyncio.sleep(interval)
                yield {"i": i}

        return event_stream(numbered())

    app.add_api_route("/work", work, methods=["POST"])
    app.add_api_route("/stream", stream, methods=["POST"])
    return ServiceGuard("layer-test", app, limits, api_key, registry=registry)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="serve_layer_app")
    add_service_arguments(parser, port=0, defaults=DEFAULTS)
    args = parser.parse_args(argv)
    guard = build(limits_from_args(args), api_key_from_env(args.api_key_env))
    return run_service(guard, args.host, args.port, "layer test service serving on {url}",
                       access_log=args.access_log)


if __name__ == "__main__":
    sys.exit(main())
