"""Mistakes a user can fix, and how the command line reports them.

`UserError` is the base of every error whose message alone says what is wrong and what to do: a config key or
value (`ConfigError`), a data file or row (`DataError`), a data_source no reward scores (`RouteError`), a model
directory, a command-line argument. `rl360` prints such an error as `rl360: KIND: MESSAGE` (KIND: config error,
data error or error) on stderr and exits with status 2, without a traceback; `--debug` (or RL360_DEBUG=1) shows
the traceback as well. Any other exception is a bug in rl360 (or a library) and keeps its traceback.

A user error raised inside a Ray worker (a data row met mid-run, a reward's config) reaches the driver wrapped:
as a `RayTaskError` whose `cause` is the error (a method), or as a `RayActorError` whose message ends in the
error's `module.Class: message` line (an actor's `__init__`), possibly chained under the error of the code that
called it. `run_command` reports the user error inside the same way as one raised in the driver.

A run stopped by a signal at a safe point (`rl360.stopping`) raises `RunStopped`: `run_command` prints its one
line and exits with STOPPED_EXIT.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

USAGE_EXIT = 2  # what argparse returns for a bad argument; every user error exits with it too
# a run stopped by SIGINT, SIGTERM or SIGUSR1 after writing its checkpoint: sysexits.h's EX_TEMPFAIL ("a temporary
# failure; the user is invited to retry"), apart from success (0), a crash (1), a user error (2) and a death by a
# signal (128 + N), so a job script can tell "stopped, run the same command to resume" from each of them
STOPPED_EXIT = 75
DEBUG_ENV = "RL360_DEBUG"


class UserError(ValueError):
    """Something the user gave is wrong (a config key, a file, a row, a flag); the message names it and says
    what to do. `label` is the kind the command line prints before it."""

    label = "error"


class ConfigError(UserError):
    """A configuration key or value is wrong; the message names it."""

    label = "config error"


class RunStopped(Exception):
    """A run stopped by a signal at a safe point; `str()` is the line the command line prints."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path | None, note: str = ""):
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        where = f"at step {step}" if step else "before its first step"
        saved = f"checkpoint {checkpoint}" if checkpoint is not None else "no checkpoint yet"
        again = "resume" if checkpoint is not None else "start again"
        super().__init__(f"rl360: stopped by {signal_name} {where}{note}; {saved}; run the same command to {again}")


def debug_enabled(flag: bool = False) -> bool:
    """Whether tracebacks of user errors are shown: `--debug`, or RL360_DEBUG set to anything but "", 0, false."""
    return flag or os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def run_command(run: Callable[[Any], int], args: Any, prog: str = "rl360", debug: bool = False) -> int:
    """`run(args)`, with a `UserError` printed as one `PROG: KIND: MESSAGE` line (its traceback before it when
    debugging) and exit status 2. A `SystemExit` carrying a message (a service that refuses its options) is
    reported the same way; a `RunStopped` as its line and STOPPED_EXIT; other exceptions propagate with their
    tracebacks."""
    try:
        return run(args)
    except RunStopped as stopped:
        if debug_enabled(debug) and stopped.__cause__ is not None:
            traceback.print_exception(stopped.__cause__)
        print(stopped, file=sys.stderr, flush=True)
        return STOPPED_EXIT
    except SystemExit as err:
        if not isinstance(err.code, str):
            raise
        if debug_enabled(debug):
            traceback.print_exc()
        print(f"{prog}: error: {err.code}", file=sys.stderr, flush=True)
        return USAGE_EXIT
    except Exception as err:
        user_error = user_error_in(err)
        if user_error is None:
            raise
        if debug_enabled(debug):
            traceback.print_exc()
        print(user_error_line(user_error, prog), file=sys.stderr, flush=True)
        return USAGE_EXIT


def user_error_line(error: UserError, prog: str = "rl360") -> str:
    """How the command line reports a user error: `PROG: KIND: MESSAGE`."""
    return f"{prog}: {error.label}: {error}"


def user_error_in(err: BaseException) -> UserError | None:
    """The `UserError` that `err` is or wraps (a Ray task's or actor's error, an exception's cause or context,
    outermost first); None when there is none."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [err]
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        cause = getattr(current, "cause", None)  # ray.exceptions.RayTaskError: the worker's exception
        if isinstance(cause, BaseException):
            pending.append(cause)
        elif isinstance(current, UserError):
            return current
        if _is_ray_actor_error(current) and getattr(current, "actor_init_failed", False):
            found = _user_error_from_message(str(current))
            if found is not None:
                return found
        pending += [current.__cause__, current.__context__]
    return None


# the last line of a Python traceback: `package.module.ErrorClass: message`
_EXCEPTION_LINE = re.compile(r"^((?:[A-Za-z_]\w*\.)+)([A-Za-z_]\w*): (.+)$")


def _user_error_from_message(text: str) -> UserError | None:
    """An actor whose `__init__` raised reports only text (Ray keeps no exception object): its last exception
    line, rebuilt as that UserError class when the class is one."""
    for line in reversed(text.splitlines()):
        match = _EXCEPTION_LINE.match(line.strip())
        if match is None:
            continue
        try:
            cls = getattr(importlib.import_module(match.group(1)[:-1]), match.group(2))
        except (ImportError, AttributeError):
            return None
        return cls(match.group(3)) if isinstance(cls, type) and issubclass(cls, UserError) else None
    return None


def _is_ray_actor_error(err: BaseException) -> bool:
    ray_exceptions = sys.modules.get("ray.exceptions")  # Ray's errors exist only where Ray was imported
    return ray_exceptions is not None and isinstance(err, ray_exceptions.RayActorError)
