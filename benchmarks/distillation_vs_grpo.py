"""On-policy distillation against GRPO from the reward, on the CPU quickstart, from one run of this script:

    python benchmarks/distillation_vs_grpo.py [--grpo-steps 400] [--distill-steps 200] [--reuse]

1. GRPO: `rl360 quickstart` (the tiny random Qwen2 learns single-digit addition from its reward alone); its final
   checkpoint is the teacher.
2. Distillation: the same random model, data and seed, trained on the teacher's per-token log-probs alone
   (`distill.teacher_model=<GRPO run>/hf`, `distill.reward_weight=0`: the reward is computed and logged, not
   trained on).

Prints, side by side, the steps each run took until its reward (the fraction of right answers, sampled at
temperature 1) averaged over 5 steps first reached 0.8 and the teacher's final level, its first-5 and last-5
reward and its mean step time. Writes benchmarks/results/distillation_cpu.json and both reward curves to
docs/images/distillation_vs_grpo.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "outputs" / "bench_distillation"
WINDOW = 5


def run(name: str, steps: int, reuse: bool, overrides: list[str]) -> list[dict]:
    out_dir = OUT / name
    metrics = out_dir / "metrics.jsonl"
    if not (reuse and metrics.exists()):
        subprocess.run([sys.executable, "-m", "rl360.cli", "quickstart", f"output_dir={out_dir}",
                        f"trainer.total_steps={steps}", *overrides], check=True, cwd=REPO)
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def steps_to(rewards: list[float], level: float) -> int | None:
    """The first step at which the mean reward of the last WINDOW steps is >= level (None: never)."""
    for end in range(WINDOW, len(rewards) + 1):
        if sum(rewards[end - WINDOW:end]) / WINDOW >= level:
            return end
    return None


def plot(curves: dict[str, list[float]], teacher_level: float, out: Path) -> None:
    """Each run's reward per step, averaged over WINDOW steps, with the 0.8 bar and the teacher's level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rewards in curves.items():
        smooth = [sum(rewards[max(0, i - WINDOW + 1):i + 1]) / len(rewards[max(0, i - WINDOW + 1):i + 1])
                  for i in range(len(rewards))]
        ax.plot(range(1, len(smooth) + 1), smooth, label=name)
    ax.axhline(0.8, color="grey", linestyle="--", linewidth=0.8, label="0.8")
    ax.axhline(teacher_level, color="black", linestyle=":", linewidth=0.8, label=f"teacher ({teacher_level:.3f})")
    ax.set(xlabel="step", ylabel=f"reward (mean of {WINDOW} steps)", ylim=(0, 1),
           title="CPU quickstart: on-policy distillation vs GRPO from the reward")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grpo-steps", type=int, default=400)
    parser.add_argument("--distill-steps", type=int, default=200)
    parser.add_argument("--reuse", action="store_true", help="read existing runs instead of training again")
    args = parser.parse_args(argv)
    runs = {"grpo": run("grpo", args.grpo_steps, args.reuse, [])}
    teacher = OUT / "grpo" / "hf"
    runs["distillation"] = run("distillation", args.distill_steps, args.reuse, [
        f"distill.teacher_model={teacher}", "distill.reward_weight=0", "trainer.save_hf=false"])
    teacher_level = sum(r["reward/mean"] for r in runs["grpo"][-WINDOW:]) / WINDOW
    rows = {}
    print(f"{'run':<13} {'steps':>5} {'to 0.8':>7} {f'to {teacher_level:.3f}':>9} {'first 5':>8} {'last 5':>7} "
          f"{'step s':>7}")
    for name, records in runs.items():
        rewards = [r["reward/mean"] for r in records]
        row = {"steps": len(rewards), "steps_to_0.8": steps_to(rewards, 0.8),
               "steps_to_teacher_level": steps_to(rewards, teacher_level),
               "first5_reward": round(sum(rewards[:WINDOW]) / WINDOW, 4),
               "last5_reward": round(sum(rewards[-WINDOW:]) / WINDOW, 4),
               "mean_step_s": round(sum(r["timing/step_s"] for r in records) / len(records), 3)}
        rows[name] = row
        print(f"{name:<13} {row['steps']:>5} {str(row['steps_to_0.8']):>7} {str(row['steps_to_teacher_level']):>9} "
              f"{row['first5_reward']:>8.3f} {row['last5_reward']:>7.3f} {row['mean_step_s']:>7.3f}")
    grpo, distill = rows["grpo"]["steps_to_0.8"], rows["distillation"]["steps_to_0.8"]
    if grpo and distill:
        print(f"steps to 0.8: distillation {distill}, GRPO {grpo} ({grpo / distill:.1f}x fewer)")
    result = {"command": "python benchmarks/distillation_vs_grpo.py"
                         + (f" --grpo-steps {args.grpo_steps}" if args.grpo_steps != 400 else "")
                         + (f" --distill-steps {args.distill_steps}" if args.distill_steps != 200 else ""),
              "device": f"CPU ({platform.processor() or platform.machine()}), 2 threads",
              "teacher": "the GRPO run's final checkpoint", "teacher_last5_reward": round(teacher_level, 4),
              "window": WINDOW, "runs": rows}
    plot({name: [r["reward/mean"] for r in records] for name, records in runs.items()}, teacher_level,
         REPO / "docs" / "images" / "distillation_vs_grpo.png")
    path = REPO / "benchmarks" / "results" / "distillation_cpu.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
