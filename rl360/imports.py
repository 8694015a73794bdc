"""Functions named by "package.module:qualname" references: the plug-in form of rewards, advantage
estimators and policy losses, which each process (reward workers, policy ranks) imports for itself. The module
may also be a Python file, "path/to/file.py:function" (verl's `custom_reward_function.path` form): each process
loads it from that path (relative to the working directory) as a module of its own."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def is_ref(name: str) -> bool:
    return isinstance(name, str) and ":" in name


def import_ref(ref: str, kind: str = "function") -> Callable[..., Any]:
    """The callable that `ref` ("package.module:qualname") names; errors name `ref` and what is wrong."""
    module_name, _, qualname = ref.partition(":")
    if not module_name or not qualname:
        raise ValueError(f"{kind} reference {ref!r} is not of the form 'package.module:function'")
    try:
        target: Any = _load_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
    except ImportError as error:
        raise type(error)(f"{kind} reference {ref!r}: cannot import {module_name!r}: {error}") from None
    for part in qualname.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise AttributeError(f"{kind} reference {ref!r}: module {module_name!r} has no {qualname!r}") from None
    if not callable(target):
        raise TypeError(f"{kind} reference {ref!r} names a {type(target).__name__}, not a function")
    return target


def _load_file(path: str) -> Any:
    """The module in the Python file `path`, loaded once per process under a name made from its full path."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ImportError(f"no such file {str(file)!r}")
    name = f"rl360_file_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as error:
        del sys.modules[name]
        raise ImportError(f"{file} raised {type(error).__name__}: {error}") from None
    return module
