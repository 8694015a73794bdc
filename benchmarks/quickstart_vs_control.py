"""A quickstart against its control, from one run of this script:

    python benchmarks/quickstart_vs_control.py [--task vision|zoom|tools] [--steps N] [--reuse] [overrides ...]

Runs `rl360 quickstart --task TASK` and `rl360 quickstart --task TASK-control` with the same seed and steps, each
in its own process, and prints the mean reward of the first and last 5 steps side by side (and, for the tool
tasks, the tool calls per sample): the control can learn the answer format but not the answer, so the gap is
what the image or the tool gives.

- `vision`: a tiny random Qwen2.5-VL names the colour filling most of an image; the control's images are plain
  grey squares (chance 0.25).
- `zoom`: the colour of a mark only `image_zoom_in_tool`'s crop shows; the control has no tool (chance 0.25).
- `tools`: `a*b%7` of two 6-digit numbers, which the python tool computes; the control has no tool (chance 1/6).

Further `key=value` arguments are config overrides for both runs. `--steps` defaults to the task's config.
Writes benchmarks/results/TASK_quickstart_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


CHANCE = {"vision": 1 / 4, "zoom": 1 / 4, "tools": 1 / 6}


def run_task(task: str, steps: int | None, reuse: bool, overrides: list[str]) -> tuple[list[dict], float]:
    """The task's metrics records, one per step, and its mean step time in seconds."""
    out_dir = REPO / "outputs" / f"quickstart_{task.replace('-', '_')}"
    metrics = out_dir / "metrics.jsonl"
    if not (reuse and metrics.exists()):
        length = [f"trainer.total_steps={steps}"] if steps else []
        subprocess.run([sys.executable, "-m", "rl360.cli", "quickstart", "--task", task, *length,
                        f"output_dir={out_dir}", "trainer.save_hf=false", *overrides], check=True, cwd=REPO)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return records, sum(r["timing/step_s"] for r in records) / len(records)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(CHANCE), default="vision")
    parser.add_argument("--steps", type=int, default=None, help="steps of each run (default: the task's config)")
    parser.add_argument("--reuse", action="store_true", help="read existing runs instead of training again")
    parser.add_argument("--out", help="result file (default benchmarks/results/TASK_quickstart_cpu.json)")
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value) for both runs")
    args = parser.parse_args(argv)
    out = args.out or str(REPO / f"benchmarks/results/{args.task}_quickstart_cpu.json")
    control = f"{args.task}-control"
    runs = {task: run_task(task, args.steps, args.reuse, args.overrides) for task in (args.task, control)}
    print(f"{'task':<15} {'steps':>5} {'first 5':>8} {'last 5':>8} {'calls first 5':>14} {'calls last 5':>13}")
    rows = {}
    for task, (records, seconds) in runs.items():
        rewards = [r["reward/mean"] for r in records]
        calls = [r.get("agent/tool_calls/mean", 0.0) for r in records]
        first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        rows[task] = {"steps": len(rewards), "first5_reward": round(first, 4), "last5_reward": round(last, 4),
                      "mean_step_s": round(seconds, 2)}
        if args.task != "vision":
            rows[task] |= {"first5_tool_calls": round(sum(calls[:5]) / 5, 4),
                           "last5_tool_calls": round(sum(calls[-5:]) / 5, 4)}
        print(f"{task:<15} {len(rewards):>5} {first:>8.3f} {last:>8.3f} {sum(calls[:5]) / 5:>14.3f} "
              f"{sum(calls[-5:]) / 5:>13.3f}")
    gap = rows[args.task]["last5_reward"] - rows[control]["last5_reward"]
    ratio = rows[args.task]["last5_reward"] / max(rows[control]["last5_reward"], 1e-9)
    print(f"last-5 reward, {args.task} over {control}: +{gap:.3f}, {ratio:.2f}x (chance {CHANCE[args.task]:.3f})")
    command = " ".join(["python benchmarks/quickstart_vs_control.py"] + (["--task", args.task] if args.task != "vision"
                                                                         else [])
                       + ([f"--steps {args.steps}"] if args.steps else []) + args.overrides)
    result = {"command": command, "device": f"CPU ({platform.processor() or platform.machine()}), 2 threads",
              "runs": rows, f"last5_gap_{args.task}_over_control": round(gap, 3),
              f"last5_ratio_{args.task}_over_control": round(ratio, 3)}
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
