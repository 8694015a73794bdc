"""`python`, PyVision's tool: run the model's Python code over the conversation's images, in the sandbox.

**One interpreter state per trajectory, by replay.** Each call is one fresh run of `rl360.rewards.sandbox`
(its own uid, no network, private tmpfs, memory polling, CPU/address-space/file limits, scrubbed environment)
that first re-runs the trajectory's earlier successful cells, silently, and then the new one. So variables,
imports and files of earlier calls are there, as in a notebook, while every call keeps the sandbox's
run-to-completion isolation: nothing lives between calls, a cell that crashes, hangs or floods cannot leave
a broken interpreter behind (a cell that raises or is stopped is not kept; one whose output was cut is), and
two trajectories never share a process. The price:
earlier cells' time is paid again (the wall-clock cap of a call is `timeout_s` plus 1.5 x the earlier cells'
own time), and a cell whose result depends on chance or the clock may differ on replay (`random` is seeded
per trajectory). A persistent interpreter would be cheaper per call but needs a long-lived sandbox process
and a request protocol the sandbox does not have; agent trajectories are a handful of cells, so replay wins.

**Images in**: the trajectory's images (the prompt's, then those tools returned) are files `image_clue_0.png`,
`image_clue_1.jpg`, ... in the working directory, and, where PIL imports, PIL images `image_clue_0`, ...
(PyVision's names). **Variables in**: the prompt row's `extra_info.tools_kwargs.python.create_kwargs.variables`
(a JSON object) are bound as names before the first cell runs, e.g. `{"a": 123456, "b": 654321}` gives `a`
and `b`. **Images out**: PIL images `.show()`n, matplotlib figures left open, and image files the
cell writes into the working directory come back as images (resized by Qwen-VL's rule within max_pixels and
charged to the trajectory's image-token budget; past it they are dropped, with an error).

**Concurrency**: calls run in a pool of worker processes (`workers`, default the CPU count), one sandbox per
worker at a time, since the sandbox's uid is per process: calls of many trajectories run side by side, each
with its own uid, memory cap and sweep.

**Output**: what the cell prints (stdout and stderr, traceback included) up to `max_output_chars`; more is
cut and the call counts as an error. A call that raises, times out, runs out of memory or floods its pipe
returns an error reply, never an exception.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import multiprocessing
import os
import secrets
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from rl360.agents.tools.base import ToolReply, ToolSettings, TrajectoryState, register_tool
from rl360.agents.tools.images import image_suffix, image_tokens, smart_resize

_DRIVER = r'''
import base64, contextlib, io, json, os, random, sys, time, traceback
os.environ["MPLBACKEND"] = "Agg"
MARK, LIMIT = __MARK__, __LIMIT__
cells, code, inputs = json.loads(__CELLS__), json.loads(__CODE__), json.loads(__INPUTS__)
random.seed(__SEED__)

class Capture(io.TextIOBase):
    def __init__(self, limit):
        self.parts, self.kept, self.dropped, self.limit = [], 0, 0, limit
    def writable(self):
        return True
    def write(self, text):
        room = max(self.limit - self.kept, 0)
        self.parts.append(text[:room])
        self.kept += min(len(text), room)
        self.dropped += max(len(text) - room, 0)
        return len(text)

shown = []
scope = {"__name__": "__main__", "__builtins__": __builtins__}
scope.update(json.loads(__VARIABLES__))
for i, (name, data) in enumerate(inputs):
    with open(name, "wb") as f:
        f.write(base64.b64decode(data))
try:
    from PIL import Image
    Image.Image.show = lambda self, *a, **k: shown.append(self.copy())
    for i, (name, _) in enumerate(inputs):
        scope["image_clue_%d" % i] = Image.open(name)
        scope["image_clue_%d" % i].load()
except ImportError:
    pass

def close_figures(keep):
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    for number in plt.get_fignums():
        if keep:
            buffer = io.BytesIO()
            plt.figure(number).savefig(buffer, format="png")
            shown.append(buffer.getvalue())
        plt.close(number)

def run(source, out):
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            exec(compile(source, "<cell>", "exec"), scope)
            return ""
        except SystemExit as error:
            return "" if error.code in (None, 0) else "SystemExit: %r" % (error.code,)
        except BaseException as error:
            traceback.print_exception(type(error), error, error.__traceback__.tb_next)
            return "%s: %s" % (type(error).__name__, error)

real_stdout = sys.stdout
result = {"output": "", "error": "", "dropped": 0, "images": [], "seconds": 0.0}
for number, cell in enumerate(cells):
    failure = run(cell, Capture(0))
    if failure:
        result["error"] = "an earlier cell (%d) failed when re-run: %s" % (number + 1, failure)
        break
close_figures(False)
del shown[:]
if not result["error"]:
    before = {name: os.stat(name).st_mtime_ns for name in os.listdir(".") if os.path.isfile(name)}
    capture, started = Capture(LIMIT), time.monotonic()
    result["error"] = run(code, capture)
    result["seconds"] = time.monotonic() - started
    result["output"], result["dropped"] = "".join(capture.parts), capture.dropped
    close_figures(True)
    for name in sorted(os.listdir(".")):
        if (name.lower().endswith((".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")) and os.path.isfile(name)
                and before.get(name) != os.stat(name).st_mtime_ns):
            with open(name, "rb") as f:
                shown.append(f.read())
    for image in shown:
        if not isinstance(image, bytes):
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            image = buffer.getvalue()
        result["images"].append(base64.b64encode(image).decode())
real_stdout.write(MARK + json.dumps(result))
real_stdout.flush()
'''

_STORE = "python"  # TrajectoryState.store key: {"cells": [...], "seconds": [...]}
_MAX_IMAGES = 8  # images one call may return


def driver(cells: list[str], code: str, inputs: list[tuple[str, bytes]], limit: int, seed: int, mark: str,
           variables: dict[str, Any] | None = None) -> str:
    """The script one call runs: `variables` (JSON values) bound, `inputs` (file name, bytes) written out,
    `cells` replayed, `code` run."""
    encoded = [(name, base64.b64encode(data).decode()) for name, data in inputs]
    values = {"__MARK__": repr(mark), "__LIMIT__": str(int(limit)), "__CELLS__": repr(json.dumps(cells)),
              "__CODE__": repr(json.dumps(code)), "__INPUTS__": repr(json.dumps(encoded)), "__SEED__": str(seed),
              "__VARIABLES__": repr(json.dumps(variables or {}))}
    script = _DRIVER
    for key, value in values.items():
        script = script.replace(key, value, 1)
    return script


@register_tool("python")
class PythonTool:
    name = "python"
    manages_timeout = True  # its sandbox run has its own wall-clock cap (the loop adds none)
    schema = {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code, e.g. to crop, enhance or measure the images (image_clue_0, ... as PIL "
                           "images and files). Variables persist between calls. Print what you need to see; "
                           "images you .show(), plot or save come back to you.",
            "parameters": {"type": "object",
                           "properties": {"code": {"type": "string", "description": "The Python code to run."}},
                           "required": ["code"]},
        },
    }

    def __init__(self, settings: ToolSettings):
        self.settings = settings
        self._pool: ProcessPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    async def call(self, arguments: dict[str, Any], state: TrajectoryState) -> ToolReply:
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            return ToolReply(error="the python tool needs a non-empty string argument 'code'")
        return await asyncio.to_thread(self.run, code, state)

    def run(self, code: str, state: TrajectoryState) -> ToolReply:
        """Run `code` as the trajectory's next cell (in one of the tool's worker processes); the reply."""
        from rl360.rewards.sandbox import SandboxLimits

        memory = state.store.setdefault(_STORE, {"cells": [], "seconds": []})
        mark = "\n@@rl360-python-" + secrets.token_hex(8) + "@@"
        inputs = [(f"image_clue_{i}{image_suffix(data)}", data) for i, data in enumerate(state.images)]
        variables = state.kwargs.get(self.name, {}).get("variables") or {}
        if not isinstance(variables, dict) or not all(isinstance(key, str) and key.isidentifier() for key in variables):
            return ToolReply(error="the row's tools_kwargs.python.create_kwargs.variables must map Python names to "
                                   "values")
        script = driver(memory["cells"], code, inputs, self.settings.max_output_chars, state.seed, mark, variables)
        timeout = self.settings.timeout_s + 1.5 * sum(memory["seconds"])
        limits = SandboxLimits(timeout_s=timeout, memory_bytes=self.settings.memory_mb << 20,
                               max_output_bytes=max(4 * self.settings.max_output_chars, 32 << 20))
        pool = self._workers()
        try:
            result = pool.submit(_run_cell, self.settings.python, script, limits, _sandbox_environ()).result()
        except BrokenProcessPool:  # a worker died (killed from outside): the next call gets a new pool
            with self._pool_lock:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            return ToolReply(error="the code was not run: the tool's worker process died; call again")
        if isinstance(result, str):
            return ToolReply(error=f"the code was not run: {result}")
        if result.timed_out:
            return ToolReply(_tail(result.stdout, self.settings.max_output_chars),
                             error=f"the code ran past the time limit of {self.settings.timeout_s:g} s and was "
                                   "stopped", timed_out=True)
        head, found, envelope = result.stdout.rpartition(mark)
        if not found:
            why = (f"it used more than the memory limit of {self.settings.memory_mb} MB" if result.memory_exceeded
                   else "it wrote more output than allowed" if result.output_truncated
                   else result.error or f"it exited with status {result.returncode} {result.killed_by_signal or ''}")
            text = _tail(head + result.stderr, self.settings.max_output_chars)
            return ToolReply(text, error=f"the code was stopped: {why.strip()}")
        try:
            report = json.loads(envelope)
        except json.JSONDecodeError:
            return ToolReply(error="the code's result could not be read (did it write to the real stdout?)")
        text, error = report["output"], report["error"]
        if not error:  # it ran through (even if its output or images are cut below): later calls see its state
            memory["cells"].append(code)
            memory["seconds"].append(report["seconds"])
        stray = head + result.stderr  # what bypassed sys.stdout (os.write, subprocesses)
        if stray.strip():
            text = (text + stray)[: self.settings.max_output_chars]
        if report["dropped"]:
            text += f"\n... [{report['dropped']} more characters of output cut]"
            error = error or (f"the output was longer than {self.settings.max_output_chars} characters and was cut; "
                              "print less")
        images, refused = self._images(report["images"], state)
        if refused:
            error = error or refused
        return ToolReply(text, tuple(images), error)

    def _workers(self) -> ProcessPoolExecutor:
        """The worker processes, started on first use: each runs one sandbox at a time, so concurrent calls
        never share a sandbox uid (the sandbox gives each process one: two runs under it would share its memory
        cap and the sweep of its processes at the end of either)."""
        with self._pool_lock:
            if self._pool is None:
                workers = self.settings.workers or os.cpu_count() or 1
                self._pool = ProcessPoolExecutor(max_workers=workers, mp_context=_mp_context(),
                                                 initializer=_worker_start)
            return self._pool

    def close(self) -> None:
        """Stop the worker processes (a later call starts new ones)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _images(self, encoded: list[str], state: TrajectoryState) -> tuple[list[bytes], str]:
        """The images a cell returned, resized and charged to the budget; why some were dropped ("" if none)."""
        from PIL import Image

        images, dropped = [], 0
        for data in encoded[:_MAX_IMAGES]:
            try:
                image = Image.open(io.BytesIO(base64.b64decode(data)))
                image.load()
            except Exception:  # an unreadable file the code wrote: not an image after all
                continue
            tokens = image_tokens(image.height, image.width, self.settings.min_pixels, self.settings.max_pixels)
            if state.image_tokens + tokens > self.settings.max_image_tokens:
                dropped += 1
                continue
            state.image_tokens += tokens
            height, width = smart_resize(image.height, image.width, self.settings.min_pixels, self.settings.max_pixels)
            buffer = io.BytesIO()
            image.convert("RGB").resize((width, height), Image.Resampling.BICUBIC).save(buffer, format="PNG")
            images.append(buffer.getvalue())
        dropped += max(len(encoded) - _MAX_IMAGES, 0)
        why = (f"{dropped} image(s) were not returned: the image budget of this conversation "
               f"({self.settings.max_image_tokens} tokens) or the limit of {_MAX_IMAGES} images per call was reached"
               if dropped else "")
        return images, why


def _mp_context() -> multiprocessing.context.BaseContext:
    return multiprocessing.get_context("forkserver" if "forkserver" in multiprocessing.get_all_start_methods()
                                       else "spawn")


def _worker_start() -> None:
    """In each worker: Ctrl-C is the parent's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _sandbox_environ() -> dict[str, str | None]:
    """This process's sandbox settings (RL360_SANDBOX_ISOLATION, ..._REQUIRE_ISOLATION), for a worker to run with:
    workers are forked from a server started earlier, with the environment of that time."""
    from rl360.rewards.sandbox import ISOLATION_ENV, REQUIRE_ENV

    return {name: os.environ.get(name) for name in (ISOLATION_ENV, REQUIRE_ENV)}


def _run_cell(python: str, script: str, limits: Any, environ: dict[str, str | None]) -> Any:
    """In a worker: run the driver `script` in the sandbox with the caller's sandbox settings `environ`; its
    `SandboxResult`, or why it could not run."""
    from rl360.rewards.sandbox import IsolationError, run_command, sandbox_python

    for name, value in environ.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        python = python or sandbox_python()
        if python is None:
            return "no Python interpreter runs inside the sandbox here"
        return run_command([python, "-I", "-B", "cell.py"], {"cell.py": script}, limits=limits)
    except (IsolationError, OSError, ValueError) as error:
        return str(error)


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "... " + text[-limit:]
