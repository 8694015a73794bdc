"""What a run shows on its console, and the copy of it in `<output_dir>/train.log`.

- Plain text when stdout is not a terminal: Ray's coloured worker prefixes off (`RAY_COLOR_PREFIX=0`), so a piped
  or redirected run holds no ANSI escape codes; `train.log` never holds any.
- Known dependency notices shown once: megatron warns that Transformer Engine / Apex are not installed from
  every process that imports it (the driver and each worker, several times each); those warnings are filtered
  in every process (`PYTHONWARNINGS`, inherited by Ray's workers) and the driver prints one line instead.
  (So is a deprecation megatron raises about its own default, which no setting of ours changes.)
- `RunLog`: everything the driver prints (its own lines and the worker lines Ray forwards) is also appended to
  `train.log`, a resumed run's after the earlier run's; a run stopped by an exception ends its log with the
  exception's traceback (and, for a user error, the one line the command line shows).
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import TextIO

from rl360.errors import RunStopped, user_error_in, user_error_line

LOG_FILE = "train.log"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# the start of each known notice (PYTHONWARNINGS matches a message's start, case-insensitively, with no commas)
KNOWN_NOTICES = ("Transformer Engine and Apex are not installed", "Apex is not installed",
                 "full scope is deprecated")  # the last: megatron's own default of cuda_graph_scope


def quiet_known_warnings() -> None:
    """Filter the known dependency notices in this process and in every process started after this call."""
    for notice in KNOWN_NOTICES:
        warnings.filterwarnings("ignore", message=re.escape(notice))
    entries = [f"ignore:{notice}" for notice in KNOWN_NOTICES]
    current = os.environ.get("PYTHONWARNINGS", "")
    missing = [entry for entry in entries if entry not in current.split(",")]
    if missing:
        os.environ["PYTHONWARNINGS"] = ",".join(([current] if current else []) + missing)


def plain_when_piped(stream: TextIO | None = None) -> None:
    """No colour codes in Ray's forwarded worker lines when `stream` (stdout) is not a terminal (a setting of
    RAY_COLOR_PREFIX by the user is kept)."""
    stream = stream or sys.stdout
    if not _isatty(stream):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def dependency_note() -> str | None:
    """The one line that replaces the filtered notices, when they apply (Transformer Engine or Apex missing)."""
    missing = [name for name, module in (("Transformer Engine", "transformer_engine"), ("Apex", "apex"))
               if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    return f"note: {' and '.join(missing)} not installed: megatron uses its torch implementations instead"


def format_duration(seconds: float) -> str:
    """`1:02:03`, `2:03` (minutes:seconds under an hour)."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class RunLog:
    """While open, what this process writes to stdout and stderr also goes, without colour codes, to `path`
    (appended), and an exception that ends it, with its traceback, to `path` only. A context manager; it
    restores the streams it replaced."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file: TextIO | None = None
        self._saved: tuple[TextIO, TextIO] | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> RunLog:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()  # Ray forwards worker lines from a thread of its own
        self._saved = (sys.stdout, sys.stderr)
        sys.stdout = _Tee(sys.stdout, self._file, self._lock)
        sys.stderr = _Tee(sys.stderr, self._file, self._lock)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if isinstance(exc, RunStopped) and self._file is not None:  # stopped by a signal: its line (and what
            with self._lock:  # failed while stopping, in full)
                if exc.__cause__ is not None:
                    self._file.write("".join(traceback.format_exception(exc.__cause__)))
                self._file.write(f"{exc}\n")
        elif exc is not None and self._file is not None:  # why the run stopped, in full, in the log (the console
            with self._lock:  # shows it as the command line reports it), and a user error's line as shown
                self._file.write("".join(traceback.format_exception(exc_type, exc, tb)))
                user_error = user_error_in(exc)
                if user_error is not None:
                    self._file.write(user_error_line(user_error) + "\n")
        if self._saved is not None:
            sys.stdout, sys.stderr = self._saved
            self._saved = None
        if self._file is not None:
            self._file.close()
            self._file = None


class _Tee:
    """A text stream writing to the console stream it wraps and to a log file (colour codes removed); every
    other attribute (fileno, isatty, encoding, ...) is the console stream's."""

    def __init__(self, console: TextIO, log: TextIO, lock: threading.Lock):
        self._console, self._log, self._lock = console, log, lock

    def write(self, text: str) -> int:
        written = self._console.write(text)
        with self._lock:
            if not self._log.closed:
                self._log.write(ANSI.sub("", text))
        return written

    def flush(self) -> None:
        self._console.flush()
        with self._lock:
            if not self._log.closed:
                self._log.flush()

    def __getattr__(self, name: str):
        return getattr(self._console, name)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
