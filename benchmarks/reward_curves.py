"""Train the quickstart with several algorithm presets and plot their reward curves in one image.

    python benchmarks/reward_curves.py --presets grpo dapo gspo ppo --out docs/images/quickstart_rewards.png

Each preset runs `rl360 train configs/quickstart.yaml configs/algorithms/<preset>.yaml` in its own
process (skipped when `--reuse` finds its metrics.jsonl already there); the plot shows `reward/mean` per
step, smoothed over a 10-step window, and the table printed at the end gives, for each preset, the mean
reward of the first and last 5 steps side by side.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_preset(preset: str, out_dir: Path, reuse: bool) -> list[float]:
    metrics = out_dir / "metrics.jsonl"
    if not (reuse and metrics.exists()):
        subprocess.run([sys.executable, "-m", "rl360.cli", "train", str(REPO / "configs/quickstart.yaml"),
                        str(REPO / f"configs/algorithms/{preset}.yaml"), f"output_dir={out_dir}",
                        "trainer.save_hf=false"], check=True, cwd=REPO)
    # reward of every sampled response (with dynamic sampling, reward/mean covers only the kept groups)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r.get("reward/mean_sampled", r["reward/mean"]) for r in records]


def smooth(values: list[float], window: int = 10) -> list[float]:
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["grpo", "dapo", "gspo", "ppo"])
    parser.add_argument("--runs", default="outputs/reward_curves", help="where each preset's run goes")
    parser.add_argument("--out", default="docs/images/quickstart_rewards.png")
    parser.add_argument("--reuse", action="store_true", help="plot existing runs instead of training again")
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {p: run_preset(p, Path(args.runs) / p, args.reuse) for p in args.presets}
    fig, ax = plt.subplots(figsize=(7, 4))
    for preset, rewards in curves.items():
        ax.plot(range(1, len(rewards) + 1), smooth(rewards), label=preset)
    ax.set_xlabel("step")
    ax.set_ylabel("reward of sampled responses (10-step mean)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("quickstart: tiny Qwen2 from scratch, single-digit addition, CPU")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"{'preset':<8} {'steps':>5} {'first 5':>8} {'last 5':>8}")
    for preset, rewards in curves.items():
        print(f"{preset:<8} {len(rewards):>5} {sum(rewards[:5]) / 5:>8.3f} {sum(rewards[-5:]) / 5:>8.3f}")
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
