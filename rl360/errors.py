"""Mistakes a user can fix, and how the command line reports them.

`UserError` is the base of every error whose message alone says what is wrong and what to do: a config key or
value (`ConfigError`), a data file or row (`DataError`), a data_source no reward scores (`RouteError`), a model
directory, a command-line argument. `rl360` prints such an error as `rl360: KIND: MESSAGE` (KIND: config error,
data error or error) on stderr and exits with status 2, without a traceback; `--debug` (or RL360_DEBUG=1) shows
the traceback as well. Any other exception is a bug in rl360 (or a library) and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

USAGE_EXIT = 2  # what argparse returns for a bad argument; every user error exits with it too
DEBUG_ENV = "RL360_DEBUG"


class UserError(ValueError):
    """Something the user gave is wrong (a config key, a file, a row, a flag); the message names it and says
    what to do. `label` is the kind the command line prints before it."""

    label = "error"


def debug_enabled(flag: bool = False) -> bool:
    """Whether tracebacks of user errors are shown: `--debug`, or RL360_DEBUG set to anything but "", 0, false."""
    return flag or os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def run_command(run: Callable[[Any], int], args: Any, prog: str = "rl360", debug: bool = False) -> int:
    """`run(args)`, with a `UserError` printed as one `PROG: KIND: MESSAGE` line (its traceback before it when
    debugging) and exit status 2. A `SystemExit` carrying a message (a service that refuses its options) is
    reported the same way; other exceptions propagate with their tracebacks."""
    try:
        return run(args)
    except UserError as err:
        if debug_enabled(debug):
            traceback.print_exc()
        print(f"{prog}: {err.label}: {err}", file=sys.stderr, flush=True)
        return USAGE_EXIT
    except SystemExit as err:
        if not isinstance(err.code, str):
            raise
        if debug_enabled(debug):
            traceback.print_exc()
        print(f"{prog}: error: {err.code}", file=sys.stderr, flush=True)
        return USAGE_EXIT
