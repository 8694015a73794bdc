"""Python-tool call latency: the persistent interpreter per trajectory (taken from the warm pool, and started at
the first call without one) against the replay path (a fresh sandboxed interpreter per call that re-runs the
trajectory's earlier cells) and against a bare `subprocess` Python (a fresh interpreter per call, no sandbox,
no state), from one run.

    python benchmarks/python_tool_latency.py [--concurrency 1,16,64] [--calls 1,4,8] [--pool 16] [--out FILE]

For each number of concurrent trajectories C and calls per trajectory k, C trajectories start together and
each makes k calls in turn (a cell that updates and prints a counter, so every call depends on the state the
earlier ones left); every call's wall time, as the agent loop waits for it, counts. Printed per (C, k): p50
and p99 of each path and the ratios replay / persistent and persistent / bare, and for k > 1 the trajectories'
first calls (the persistent path starts its interpreter then) and later calls apart; written with the command
and the machine to `--out` (benchmarks/results/python_tool_latency.json).

- persistent: `rl360.agents.tools.python.PythonTool` with a warm pool of `--pool` interpreters (`agent.tool_pool`),
  full when the C trajectories start (as after the engines' decoding of a first turn) and refilled in the
  background while they run; a trajectory's first call takes a pooled interpreter, or starts one when the pool
  is empty (C > pool); each trajectory is released at its end, as the agent loop does;
- cold: the same tool without a pool (`agent.tool_pool=0`): every trajectory's first call starts its
  interpreter;
- replay: the replay path as the tool ran it before the persistent interpreter, kept here as the baseline:
  each call one `rl360.rewards.sandbox.run_command` of the driver that replays the earlier cells silently and
  then runs the new one, in a pool of forkserver worker processes (one per CPU, one sandbox each at a time);
- bare: `subprocess.run([python, "-I", "-B", "-c", cell])` per call, run from threads, with no sandbox (the
  floor of a fresh interpreter; it keeps no state, so its cell only prints).

All three run the sandbox's own interpreter (`sandbox_python()`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import secrets
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CELL = "n = globals().get('n', 0) + 1\nprint(n)"
BARE_CELL = "print(1)"
TIMEOUT_S = 120.0  # per call: a loaded machine must not turn latency into timeouts

# The replay path's driver, as the python tool ran it: variables bound, images written, the earlier cells
# re-run silently, then the new one, its output and images in a JSON envelope after a marker.
REPLAY_DRIVER = r'''
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


def replay_script(cells: list[str], code: str, mark: str) -> str:
    values = {"__MARK__": repr(mark), "__LIMIT__": "4096", "__CELLS__": repr(json.dumps(cells)),
              "__CODE__": repr(json.dumps(code)), "__INPUTS__": repr(json.dumps([])), "__SEED__": "0",
              "__VARIABLES__": repr(json.dumps({}))}
    script = REPLAY_DRIVER
    for key, value in values.items():
        script = script.replace(key, value, 1)
    return script


def replay_call(python: str, script: str, mark: str) -> str:
    """In a worker: one replay-path call; the cell's output."""
    from rl360.rewards.sandbox import SandboxLimits, run_command

    result = run_command([python, "-I", "-B", "cell.py"], {"cell.py": script},
                         limits=SandboxLimits(timeout_s=TIMEOUT_S, memory_bytes=1 << 30))
    head, found, envelope = result.stdout.rpartition(mark)
    if not found:
        raise RuntimeError(f"replay call failed: {result}")
    return json.loads(envelope)["output"]


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, -(-len(ordered) * q // 100) - 1))]


async def persistent_run(tool, concurrency: int, calls: int) -> list[float]:
    from rl360.agents.tools import TrajectoryState

    if tool.settings.pool:
        tool.warm(TIMEOUT_S)

    async def trajectory() -> list[float]:
        state, seconds = TrajectoryState(), []
        try:
            for number in range(calls):
                began = time.perf_counter()
                reply = await tool.call({"code": CELL}, state)
                seconds.append(time.perf_counter() - began)
                assert reply.text == f"{number + 1}\n" and not reply.failed, reply
        finally:
            tool.release(state)
        return seconds

    return [s for part in await asyncio.gather(*(trajectory() for _ in range(concurrency))) for s in part]


async def replay_run(pool, python: str, concurrency: int, calls: int) -> list[float]:
    loop = asyncio.get_running_loop()

    async def trajectory() -> list[float]:
        cells, seconds = [], []
        for number in range(calls):
            mark = "\n@@rl360-python-" + secrets.token_hex(8) + "@@"
            began = time.perf_counter()
            output = await loop.run_in_executor(pool, replay_call, python, replay_script(cells, CELL, mark), mark)
            seconds.append(time.perf_counter() - began)
            assert output == f"{number + 1}\n", output
            cells.append(CELL)
        return seconds

    return [s for part in await asyncio.gather(*(trajectory() for _ in range(concurrency))) for s in part]


async def bare_run(threads, python: str, concurrency: int, calls: int) -> list[float]:
    loop = asyncio.get_running_loop()

    def one() -> None:
        subprocess.run([python, "-I", "-B", "-c", BARE_CELL], check=True, capture_output=True, timeout=TIMEOUT_S)

    async def trajectory() -> list[float]:
        seconds = []
        for _ in range(calls):
            began = time.perf_counter()
            await loop.run_in_executor(threads, one)
            seconds.append(time.perf_counter() - began)
        return seconds

    return [s for part in await asyncio.gather(*(trajectory() for _ in range(concurrency))) for s in part]


def figures(seconds: list[float], calls: int) -> dict[str, float]:
    """p50 and p99 of all calls, and of the trajectories' first calls and later calls apart (a list of each
    trajectory's `calls` calls in turn)."""
    first = seconds[::calls]
    later = [s for i, s in enumerate(seconds) if i % calls]
    result = {"p50_ms": _ms(statistics.median(seconds)), "p99_ms": _ms(percentile(seconds, 99)),
              "calls": len(seconds), "first_p50_ms": _ms(statistics.median(first))}
    if later:
        result.update(later_p50_ms=_ms(statistics.median(later)), later_p99_ms=_ms(percentile(later, 99)))
    return result


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,16,64", help="concurrent trajectories, comma-separated")
    parser.add_argument("--calls", default="1,4,8", help="calls per trajectory, comma-separated")
    parser.add_argument("--pool", type=int, default=16, help="the persistent path's warm interpreters")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "python_tool_latency.json"))
    args = parser.parse_args(argv)
    from rl360.agents.tools import ToolSettings, get_tool
    from rl360.rewards.sandbox import isolation, sandbox_python

    python = sandbox_python()
    if python is None:
        print("no Python interpreter runs inside the sandbox here", file=sys.stderr)
        return 1
    print(isolation().summary())
    workers = os.cpu_count() or 1
    tool = get_tool("python", ToolSettings(timeout_s=TIMEOUT_S, memory_mb=1024, pool=args.pool))
    cold = get_tool("python", ToolSettings(timeout_s=TIMEOUT_S, memory_mb=1024))
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("forkserver"))
    threads = ThreadPoolExecutor(256)
    rows = []
    try:
        asyncio.run(persistent_run(tool, 2 * workers, 1))  # warm: worker processes started, isolation probed
        asyncio.run(persistent_run(cold, 2 * workers, 1))
        asyncio.run(replay_run(pool, python, workers, 1))
        asyncio.run(bare_run(threads, python, 1, 1))
        print(f"pool {args.pool}")
        print(f"{'C':>3} {'k':>2} | {'persistent p50/p99 ms':>21} | {'cold p50/p99 ms':>19} | "
              f"{'replay p50/p99 ms':>19} | {'bare p50/p99 ms':>17} | replay/persistent p50, p99 | persistent/bare p50")
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            for calls in [int(k) for k in args.calls.split(",")]:
                row = {"concurrency": concurrency, "calls": calls,
                       "persistent": figures(asyncio.run(persistent_run(tool, concurrency, calls)), calls),
                       "cold": figures(asyncio.run(persistent_run(cold, concurrency, calls)), calls),
                       "replay": figures(asyncio.run(replay_run(pool, python, concurrency, calls)), calls),
                       "bare": figures(asyncio.run(bare_run(threads, python, concurrency, calls)), calls)}
                p, c, r, b = row["persistent"], row["cold"], row["replay"], row["bare"]
                row["replay_over_persistent_p50"] = round(r["p50_ms"] / p["p50_ms"], 1)
                row["replay_over_persistent_p99"] = round(r["p99_ms"] / p["p99_ms"], 1)
                row["persistent_over_bare_p50"] = round(p["p50_ms"] / b["p50_ms"], 2)
                rows.append(row)
                print(f"{concurrency:>3} {calls:>2} | {p['p50_ms']:>9.1f} / {p['p99_ms']:>9.1f} | "
                      f"{c['p50_ms']:>8.1f} / {c['p99_ms']:>8.1f} | "
                      f"{r['p50_ms']:>8.1f} / {r['p99_ms']:>8.1f} | {b['p50_ms']:>7.1f} / {b['p99_ms']:>7.1f} | "
                      f"{row['replay_over_persistent_p50']:>9.1f}x, {row['replay_over_persistent_p99']:>7.1f}x"
                      f"{'':>7} | {row['persistent_over_bare_p50']:>6.2f}x", flush=True)
                if calls > 1:
                    print(f"{'':>6} | first p50 {p['first_p50_ms']:>7.1f}, later p50/p99 {p['later_p50_ms']:.1f} / "
                          f"{p['later_p99_ms']:.1f} | cold first p50 {c['first_p50_ms']:.1f} | replay first p50 "
                          f"{r['first_p50_ms']:.1f}, later p50/p99 "
                          f"{r['later_p50_ms']:.1f} / {r['later_p99_ms']:.1f}", flush=True)
    finally:
        tool.close()
        cold.close()
        pool.shutdown()
        threads.shutdown()
    result = {
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "machine": f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                   f"load average {os.getloadavg()[0]:.1f} at the end",
        "isolation": isolation().summary(),
        "interpreter": python,
        "pool": args.pool,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
