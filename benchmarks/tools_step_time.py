"""The tools quickstart's step time with the python tool's persistent interpreters against its replay mode, from
one run of this script:

    python benchmarks/tools_step_time.py [--steps 3] [--first replay|persistent] [--out FILE] [overrides ...]

Runs `rl360 quickstart --task tools` for `--steps` steps twice, each in its own process, one after the other
(`--first` first: on a shared machine whose load drifts, run it both ways), with the same seed: once with
`agent.python_replay=true` (every python call in a new sandboxed interpreter that first re-runs the
trajectory's earlier cells, stopped after the call, no warm pool) and once as configured (one persistent
interpreter per trajectory, taken from the warm pool `agent.tool_pool` when it has one). Printed side
by side: the mean step time (`timing/step_s`, all steps and the steps after the first), the python calls per
trajectory and the seconds a trajectory waited on its tools (`agent/tool_calls/mean`,
`agent/tool_seconds/mean`), their sum over the step's trajectories, and the mean reward; written with the
command and the machine to `--out` (benchmarks/results/tools_step_time_cpu.json). Further `key=value` arguments
are config overrides for both runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODES = {"replay": ["agent.python_replay=true"], "persistent": []}


def run(mode: str, steps: int, overrides: list[str]) -> tuple[list[dict], float]:
    """The run's metrics records (one per step) and its wall time in seconds."""
    out_dir = REPO / "outputs" / f"tools_step_time_{mode}"
    shutil.rmtree(out_dir, ignore_errors=True)  # a fresh run, not a resumed one
    began = time.monotonic()
    subprocess.run([sys.executable, "-m", "rl360.cli", "quickstart", "--task", "tools",
                    f"trainer.total_steps={steps}", f"output_dir={out_dir}", "trainer.save_hf=false",
                    *MODES[mode], *overrides], check=True, cwd=REPO)
    seconds = time.monotonic() - began
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()], seconds


def summary(records: list[dict], wall_s: float, trajectories: int) -> dict:
    def mean(key: str, rows: list[dict]) -> float:
        values = [row[key] for row in rows if key in row]
        return round(sum(values) / len(values), 4) if values else float("nan")

    later = records[1:] or records
    return {"steps": len(records), "step_s": mean("timing/step_s", records),
            "step_s_after_first": mean("timing/step_s", later),
            "tool_calls_per_trajectory": mean("agent/tool_calls/mean", records),
            "tool_s_per_trajectory": mean("agent/tool_seconds/mean", records),
            "tool_s_summed_per_step": round(mean("agent/tool_seconds/mean", records) * trajectories, 2),
            "reward": mean("reward/mean", records), "run_wall_s": round(wall_s, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--trajectories", type=int, default=256,
                        help="trajectories a step (data.batch_size x rollout.n of the tools quickstart)")
    parser.add_argument("--first", choices=sorted(MODES), default="replay", help="the mode run first")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "tools_step_time_cpu.json"))
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value) for both runs")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    order = sorted(MODES, key=lambda mode: mode != args.first)
    rows = {mode: summary(*run(mode, args.steps, args.overrides), args.trajectories) for mode in order}
    replay, persistent = rows["replay"], rows["persistent"]
    print(f"{'':<34} {'replay':>10} {'persistent':>11}")
    for key in ("step_s", "step_s_after_first", "tool_calls_per_trajectory", "tool_s_per_trajectory",
                "tool_s_summed_per_step", "reward", "run_wall_s"):
        print(f"{key:<34} {replay[key]:>10} {persistent[key]:>11}")
    speedup = round(replay["step_s"] / persistent["step_s"], 2)
    print(f"step time replay / persistent: {speedup}x")
    result = {
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "machine": f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                   f"load average {load:.1f} at the start and {os.getloadavg()[0]:.1f} at the end",
        "runs": rows,
        "step_replay_over_persistent": speedup,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
