"""The sender's requests to its engines: one `EngineClient` per engine URL on an asyncio loop of its own thread
(so HTTP requests run while the sending thread broadcasts or packs), a call to every engine at once, and one
`EngineError` naming every engine that failed."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import httpx

from rl360.core.client import EngineClient, EngineError


class EngineUnreachable(EngineError):
    """No reply: the engine could not be reached (the request never arrived, so nothing was received)."""


class EngineCalls:
    """The engines a sender sends to (`urls`, each with its number of ranks) and their clients."""

    def __init__(self, api_key: str | None, timeout_s: float):
        self.api_key, self.timeout_s = api_key, timeout_s
        self.clients: dict[str, EngineClient] = {}
        self.ranks: dict[str, int] = {}
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rl360-weight-sender", daemon=True)
        self._thread.start()

    @property
    def urls(self) -> list[str]:
        return list(self.clients)

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def set_engines(self, ranks: dict[str, int]) -> None:
        """Send to these engines (URL -> ranks) from now on; the previous clients are closed."""
        self.close_clients()
        self.ranks = dict(ranks)
        self.clients = {url: self.submit(self._client(url)).result() for url in ranks}

    async def _client(self, url: str) -> EngineClient:
        return EngineClient(url, api_key=self.api_key, timeout_s=self.timeout_s)

    def to_all(self, call: Callable[[EngineClient], Coroutine], urls: list[str] | None = None
               ) -> dict[str, concurrent.futures.Future]:
        """`call(client)` on every engine (of `urls`) at once: futures by URL. A transport error (the engine is
        unreachable) becomes an `EngineError` naming the URL, like a refusal."""

        async def one(client: EngineClient) -> Any:
            try:
                return await call(client)
            except (httpx.TransportError, OSError) as err:
                raise EngineUnreachable("", 0, f"unreachable ({type(err).__name__}: {err})", url=client.url) from err

        return {url: self.submit(one(self.clients[url])) for url in (self.urls if urls is None else urls)}

    def raise_failures(self, replies: dict[str, concurrent.futures.Future]) -> None:
        """Wait for every reply; raise an `EngineError` naming every engine that failed."""
        concurrent.futures.wait(replies.values())
        if any(reply.exception() is not None for reply in replies.values()):
            raise failure(replies, "", "")

    def close_clients(self) -> None:
        clients, self.clients = list(self.clients.values()), {}
        for client in clients:
            self.submit(client.close()).result()

    def stop(self) -> None:
        """Stop the loop's thread (the clients closed first)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


def failure(replies: dict[str, concurrent.futures.Future], route: str, context: str) -> EngineError:
    """One `EngineError` for the engines that failed so far (the first one's type, route, status and URL), with
    `context` first; `route` where none failed yet."""
    errors = [reply.exception() for reply in replies.values() if reply.done() and reply.exception() is not None]
    errors = [err if isinstance(err, EngineError) else EngineError(route, 0, repr(err)) for err in errors]
    if not errors:
        return EngineError(route, 0, context)
    first = errors[0]
    message = "; ".join(f"{err.url or '?'}: {err.message}" for err in errors)
    return type(first)(first.route or route, first.status, f"{context}: {message}" if context else message,
                       url=first.url)
