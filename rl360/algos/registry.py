"""A named collection of plug-in functions (advantage estimators, policy losses)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: make the function available as `name`."""

        def wrap(fn: F) -> F:
            self._entries[name] = fn
            return fn

        return wrap

    def get(self, name: str) -> F:
        if name not in self._entries:
            raise KeyError(f"unknown {self.kind} {name!r}; choose one of {self.names()}")
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)
