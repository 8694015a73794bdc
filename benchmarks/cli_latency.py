"""How long the command line takes to answer: a config mistake in `rl360 train`, `rl360 view --help`, and the
verl key table, each beside what the same answer costs when the heavy modules are imported first.

    python benchmarks/cli_latency.py [--repeats 5] [--out FILE]

Each figure is the median of `--repeats` fresh processes (`sys.executable`, this checkout on PYTHONPATH):

- `train mistake`: `rl360 train configs/quickstart.yaml data.batch_size=-1` (refused, exit 2), against the
  baseline `import rl360.trainer` then the same config check in one process (what the refusal cost when the
  command imported the trainer, megatron-core with it, before it read the config);
- `view --help`: `rl360 view --help`, against the baseline importing every command's module first;
- `verl table`: `rl360.config_docs.render_verl()` in this process (after its import), against rendering it with
  the config keys listed once per verl key (what it did when each row listed them again).

Prints each pair and its ratio and writes them with the command and the machine to `--out`
(benchmarks/results/cli_latency.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN_MISTAKE = ["-m", "rl360.cli", "train", "configs/quickstart.yaml", "data.batch_size=-1"]
TRAIN_BASELINE = ["-c", "import rl360.trainer\nfrom rl360.config import load_config\n"
                  "try:\n    load_config('configs/quickstart.yaml', ['data.batch_size=-1'])\n"
                  "except Exception as err:\n    print(err)"]
VIEW_HELP = ["-m", "rl360.cli", "view", "--help"]
VIEW_BASELINE = ["-c", "import importlib, rl360.cli\nfor ref in rl360.cli.COMMAND_PARSERS.values():\n"
                 "    importlib.import_module(ref.split(':')[0])\nrl360.cli.main(['view', '--help'])"]


def _seconds(args: list[str], repeats: int) -> float:
    """Median wall time of `repeats` fresh `python ARGS` processes run from the checkout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, timeout=600)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _verl_table_seconds() -> tuple[float, float]:
    """render_verl() as it is, and with the config keys listed once per verl key."""
    sys.path.insert(0, str(ROOT))
    from rl360.config import VERL_KEYS
    from rl360.config_docs import config_keys, render_verl

    render_verl()  # imports and caches warm
    began = time.perf_counter()
    render_verl()
    now = time.perf_counter() - began
    began = time.perf_counter()
    for _ in VERL_KEYS:
        {key for key, *_ in config_keys()}  # noqa: B018  (the per-row listing the table no longer does)
    per_row = time.perf_counter() - began + now
    return now, per_row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "cli_latency.json"))
    args = parser.parse_args(argv)
    figures = {
        "train_mistake_s": _seconds(TRAIN_MISTAKE, args.repeats),
        "train_mistake_trainer_first_s": _seconds(TRAIN_BASELINE, args.repeats),
        "view_help_s": _seconds(VIEW_HELP, args.repeats),
        "view_help_every_command_first_s": _seconds(VIEW_BASELINE, args.repeats),
    }
    figures["verl_table_s"], figures["verl_table_keys_per_row_s"] = _verl_table_seconds()
    pairs = [("train mistake refused", "train_mistake_s", "train_mistake_trainer_first_s", "trainer imported first"),
             ("view --help", "view_help_s", "view_help_every_command_first_s", "every command imported first"),
             ("verl table", "verl_table_s", "verl_table_keys_per_row_s", "keys listed per row")]
    for name, ours, base, how in pairs:
        ratio = figures[base] / figures[ours]
        print(f"{name}: {figures[ours]:.2f} s; {how}: {figures[base]:.2f} s; ratio {ratio:.1f}x")
    result = {
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "machine": f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                   f"load average {os.getloadavg()[0]:.1f} at the end",
        **{key: round(value, 3) for key, value in figures.items()},
        **{f"{ours}_ratio": round(figures[base] / figures[ours], 1) for _, ours, base, _ in pairs},
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
