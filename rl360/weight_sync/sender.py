"""`WeightSender`: full weight updates from a trainer-side process into rollout engines on SGLang's protocol,
by the strategy it is given (one module each, registered in `registry`: `distributed`, `tensor`, `disk`, ...).

    sender = WeightSender(["http://10.0.0.2:30000", ...], strategy="distributed", master_address="10.0.0.1")
    metrics = sender.send(buckets, version=7)  # buckets: an iterable of [(hf_name, tensor), ...]
    sender.set_engines(urls)                    # membership changed (an engine restarted)
    sender.close()

The sender runs in a process that holds full Hugging Face-named tensors (the policy's export rank; any plain
process works). `send` puts every bucket into every engine; the last bucket carries `flush_cache: true`, where
the engine checks that every parameter arrived and only then serves the new version (an `rl360 serve rollout`
engine stages the buckets and swaps them in at once, so a refused update leaves the old weights and version in
place). An engine that refuses raises `EngineError` naming its URL and the engine's message (e.g. the missing
weights). Every request carries `weight_version` (the decimal version): engines refuse older versions. `send`
returns `weight_sync/bytes` (the update's tensor bytes, one copy), `weight_sync/seconds`, `weight_sync/buckets`
and `weight_sync/tensors`. One sender is used by one thread. `set_engines` and `close` drop what the strategy
holds with the engines (the `distributed` group, on the engines still reachable too).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from rl360.errors import ConfigError
from rl360.weight_sync.calls import EngineCalls
from rl360.weight_sync.flat_bucket import dtype_name, is_count
from rl360.weight_sync.group import BACKENDS
from rl360.weight_sync.registry import Strategy, SyncOptions, get_strategy


class WeightSender:
    """Sends full weight updates to rollout engines (see the module docstring, and each strategy's)."""

    def __init__(self, urls: list[str], strategy: str, api_key: str | None = None, backend: str = "gloo",
                 master_address: str = "127.0.0.1", timeout_s: float = 600.0, engine_ranks: list[int] | None = None,
                 scratch_dir: str | None = None, cuda_ipc: bool = True):
        info = get_strategy(strategy)
        if backend not in BACKENDS:
            raise ConfigError(f"weight sync backend must be one of {BACKENDS}, got {backend!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ConfigError(f"timeout_s must be a positive number, got {timeout_s!r}")
        if scratch_dir is not None and not Path(scratch_dir).is_dir():
            raise ConfigError(f"scratch_dir {scratch_dir!r} is not a directory")
        self.strategy, self.backend, self.master_address = strategy, backend, master_address
        self.api_key, self.timeout_s, self.scratch_dir = api_key, float(timeout_s), scratch_dir
        self.cuda_ipc = bool(cuda_ipc)
        self.calls = EngineCalls(api_key, self.timeout_s)
        self._closed = False
        try:
            self._strategy: Strategy = info.build(self.calls, SyncOptions(backend, master_address, self.timeout_s,
                                                                          scratch_dir, self.cuda_ipc))
            self.set_engines(urls, engine_ranks)
        except BaseException:
            self.calls.stop()
            raise

    @property
    def urls(self) -> list[str]:
        return self.calls.urls

    @property
    def group_name(self) -> str | None:
        """The open weight-update group's name ("distributed"; None before the first send)."""
        return getattr(self._strategy, "group_name", None)

    def set_engines(self, urls: list[str], engine_ranks: list[int] | None = None) -> None:
        """Send to `urls` from now on (`engine_ranks`: ranks per engine; default: what a known URL had, else
        1). An open group is destroyed (on the engines still reachable too); the next send creates a new one."""
        self._check_open()
        if not isinstance(urls, list) or not urls or not all(isinstance(u, str) and u for u in urls):
            raise ConfigError(f"urls must be a non-empty list of engine URLs, got {urls!r}")
        urls = [url.rstrip("/") for url in urls]
        if len(set(urls)) != len(urls):
            raise ConfigError(f"urls name an engine twice: {urls}")
        if engine_ranks is None:
            engine_ranks = [self.calls.ranks.get(url, 1) for url in urls]
        if len(engine_ranks) != len(urls) or not all(is_count(r) and r > 0 for r in engine_ranks):
            raise ConfigError(f"engine_ranks must hold one positive integer per engine, got {engine_ranks!r}")
        self._strategy.reset()
        self.calls.set_engines(dict(zip(urls, engine_ranks)))

    def close(self) -> None:
        """Drop the strategy's state (the group, both sides) and stop; a closed sender sends nothing more."""
        if self._closed:
            return
        try:
            self._strategy.reset()
            self.calls.close_clients()
        finally:
            self._closed = True
            self.calls.stop()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> dict[str, float]:
        """Every bucket into every engine; the last one marks the update complete (`flush_cache: true`), where
        each engine checks that every parameter arrived. Returns the metrics; raises `EngineError` naming the
        engine URL and the engine's message when any engine refuses. Buckets are read one ahead (to know the
        last): a bucket's tensors must stay as they are while the next one is produced."""
        self._check_open()
        if not is_count(version):
            raise ValueError(f"version must be a non-negative integer, got {version!r}")
        started = time.perf_counter()
        totals = {"weight_sync/bytes": 0.0, "weight_sync/buckets": 0.0, "weight_sync/tensors": 0.0}
        self._strategy.send(_with_last(_checked(buckets, totals)), version)
        return {**totals, "weight_sync/seconds": time.perf_counter() - started}

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this WeightSender is closed")


def _checked(buckets: Iterable[list[tuple[str, torch.Tensor]]], totals: dict[str, float]
             ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The buckets, each checked (a non-empty list of (name, tensor) with unique names), counted into totals."""
    seen: set[str] = set()
    for index, bucket in enumerate(buckets):
        if not isinstance(bucket, (list, tuple)) or not bucket:
            raise ValueError(f"bucket {index} must be a non-empty list of (name, tensor) pairs")
        for pair in bucket:
            if (not isinstance(pair, (list, tuple)) or len(pair) != 2 or not isinstance(pair[0], str)
                    or not isinstance(pair[1], torch.Tensor)):
                raise ValueError(f"bucket {index} holds {type(pair).__name__} where a (name, tensor) pair belongs")
            name, tensor = pair
            if name in seen:
                raise ValueError(f"weight {name!r} is sent twice in one update (again in bucket {index})")
            seen.add(name)
            dtype_name(tensor.dtype)
            totals["weight_sync/bytes"] += tensor.numel() * tensor.element_size()
        totals["weight_sync/buckets"] += 1
        totals["weight_sync/tensors"] += len(bucket)
        yield list(bucket)
    if not seen:
        raise ValueError("an update needs at least one bucket")


def _with_last(items: Iterator) -> Iterator[tuple[Any, bool]]:
    """Each item with whether it is the last (one item of look-ahead)."""
    iterator = iter(items)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield current, False
        current = following
    yield current, True
