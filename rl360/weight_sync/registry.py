"""The weight-sync strategies (`rollout.weight_sync`): each module of `rl360.weight_sync` that holds one registers
it here, with the facts the config, the placement and the sender ask of it; nothing else lists them.

    @register_strategy("disk", summary="a safetensors checkpoint the engines load", engines=("server", "sglang"))
    class DiskSync:
        @classmethod
        def from_options(cls, calls, options): return cls(calls, options.scratch_dir)
        def send(self, stream, version): ...
        def reset(self): ...

    get_strategy("disk").build(calls, SyncOptions(scratch_dir="/scratch"))
    strategy_names()                                   # every registered name
    usable_strategies("sglang", shared_gpu=True)      # those reaching SGLang engines on the trainer's GPUs

The registry imports every module of the package on its first question (so each registers itself); it imports
no engine: the engine kinds are `rl360.core.engine_kinds`.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from rl360.core.engine_kinds import ENGINE_KINDS
from rl360.errors import ConfigError


@dataclass(frozen=True)
class SyncOptions:
    """What the sender was given for its strategy (each takes the options it uses)."""

    backend: str = "gloo"  # distributed: the process group's backend
    master_address: str = "127.0.0.1"  # distributed: the sender's address, which the engines join
    timeout_s: float = 600.0
    scratch_dir: str | None = None  # tensor: where shared-memory files go; disk: where the checkpoints go
    cuda_ipc: bool = True  # tensor: CUDA buckets by CUDA IPC (False: through shared memory)


class Strategy(Protocol):
    def send(self, stream: Iterator[tuple[list[tuple[str, Any]], bool]], version: int) -> None:
        """Every `(bucket, is_last)` into every engine, as weight `version`; EngineError naming those that fail."""

    def reset(self) -> None:
        """Drop what is held with the engines (the engines changed, or the sender closes)."""


@dataclass(frozen=True)
class StrategyInfo:
    name: str  # the `rollout.weight_sync` value
    cls: type  # built by its `from_options(calls, options)` classmethod
    summary: str  # one line for the config reference
    engines: tuple[str, ...]  # the engine kinds (`rl360.core.engine_kinds`) whose processes take it
    engines_note: str = ""  # why the other kinds cannot (said when one is asked for with it)
    same_host: bool = False  # reaches only engines on the sender's node (not rollout.engine_hosts=ray)
    shares_gpu: bool = True  # reaches an engine on the sender's own GPU (engines colocated with the trainer)
    gpu_note: str = ""  # why it cannot (shares_gpu=False)
    # the placement takes it in the user's place when the strategy asked for cannot share a GPU with the engines
    stand_in: bool = False

    def build(self, calls: Any, options: SyncOptions) -> Strategy:
        """The strategy sending through `calls` (the sender's `EngineCalls`)."""
        return self.cls.from_options(calls, options)

    def reaches(self, engine: str, shared_gpu: bool = False) -> bool:
        """Whether `engine` processes take it (on the sender's own GPU with `shared_gpu`)."""
        return engine in self.engines and (self.shares_gpu or not shared_gpu)


_STRATEGIES: dict[str, StrategyInfo] = {}
_loaded = False


def register_strategy(name: str, *, summary: str, engines: tuple[str, ...], **facts: Any) -> Callable[[type], type]:
    """A class decorator registering the class as strategy `name` (`facts`: the other `StrategyInfo` fields)."""
    unknown = sorted(set(engines) - ENGINE_KINDS.keys())
    if unknown:
        raise ValueError(f"weight sync strategy {name!r} names engine kinds that do not exist: {unknown}")

    def register(cls: type) -> type:
        if not callable(getattr(cls, "from_options", None)):
            raise TypeError(f"weight sync strategy {name!r}: {cls.__name__} needs a from_options(calls, options) "
                            "classmethod")
        if name in _STRATEGIES and _STRATEGIES[name].cls.__qualname__ != cls.__qualname__:
            raise ValueError(f"weight sync strategy {name!r} is registered already ({_STRATEGIES[name].cls})")
        _STRATEGIES[name] = StrategyInfo(name, cls, summary, tuple(engines), **facts)
        return cls

    return register


def unregister_strategy(name: str) -> None:
    _STRATEGIES.pop(name, None)


def strategies() -> dict[str, StrategyInfo]:
    """Every registered strategy by name, in the names' order (whatever order the modules were imported in), the
    package's own modules loaded first."""
    global _loaded
    if not _loaded:
        package = importlib.import_module(__package__)
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{__package__}.{module.name}")
        _loaded = True
    return dict(sorted(_STRATEGIES.items()))


def strategy_names() -> tuple[str, ...]:
    return tuple(strategies())


def strategy_summaries() -> dict[str, str]:
    return {name: info.summary for name, info in strategies().items()}


def get_strategy(name: str) -> StrategyInfo:
    """The strategy `name`; ConfigError naming the registered ones."""
    known = strategies()
    if name not in known:
        raise ConfigError(f"weight sync strategy must be one of {tuple(known)}, got {name!r}")
    return known[name]


def usable_strategies(engine: str, shared_gpu: bool = False, other_hosts: bool = False) -> list[str]:
    """The strategies `engine` processes take (on the sender's own GPU with `shared_gpu`; on other nodes than the
    sender's with `other_hosts`), in the names' order."""
    return [name for name, info in strategies().items()
            if info.reaches(engine, shared_gpu) and not (other_hosts and info.same_host)]
