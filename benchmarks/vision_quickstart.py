"""The vision quickstart against its text-only control, from one run of this script:

    python benchmarks/vision_quickstart.py [--steps 60] [--reuse]

Runs `rl360 quickstart --task vision` (a tiny random Qwen2.5-VL names the colour filling most of an image) and
`rl360 quickstart --task vision-control` (the same prompts and answers, every image a plain grey square) with the
same seed and steps, each in its own process, and prints the mean reward of the first and last 5 steps side by
side: the control can learn the answer format but not the answer (chance is 0.25), so the gap is what the image
gives. Writes benchmarks/results/vision_quickstart_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASKS = ("vision", "vision-control")


def run_task(task: str, steps: int, reuse: bool) -> tuple[list[float], float]:
    """The task's reward/mean per step and its mean step time in seconds."""
    out_dir = REPO / "outputs" / f"quickstart_{task.replace('-', '_')}"
    metrics = out_dir / "metrics.jsonl"
    if not (reuse and metrics.exists()):
        subprocess.run([sys.executable, "-m", "rl360.cli", "quickstart", "--task", task,
                        f"trainer.total_steps={steps}", f"output_dir={out_dir}", "trainer.save_hf=false"],
                       check=True, cwd=REPO)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["reward/mean"] for r in records], sum(r["timing/step_s"] for r in records) / len(records)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--reuse", action="store_true", help="read existing runs instead of training again")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/vision_quickstart_cpu.json"))
    args = parser.parse_args(argv)
    runs = {task: run_task(task, args.steps, args.reuse) for task in TASKS}
    print(f"{'task':<15} {'steps':>5} {'first 5':>8} {'last 5':>8}")
    rows = {}
    for task, (rewards, seconds) in runs.items():
        first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        rows[task] = {"steps": len(rewards), "first5_reward": round(first, 4), "last5_reward": round(last, 4),
                      "mean_step_s": round(seconds, 2)}
        print(f"{task:<15} {len(rewards):>5} {first:>8.3f} {last:>8.3f}")
    ratio = rows["vision"]["last5_reward"] / max(rows["vision-control"]["last5_reward"], 1e-9)
    print(f"last-5 reward, image over blanked control: {ratio:.2f}x (chance 0.25)")
    result = {"command": "python benchmarks/vision_quickstart.py" + (f" --steps {args.steps}" if args.steps != 60
                                                                     else ""),
              "device": f"CPU ({platform.processor() or platform.machine()}), 2 threads", "runs": rows,
              "last5_ratio_vision_over_control": round(ratio, 3)}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
