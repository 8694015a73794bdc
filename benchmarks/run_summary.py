"""A training run's figures from its metrics.jsonl, as JSON beside the device they ran on:

    python benchmarks/run_summary.py NAME OUTPUT_DIR [--json PATH] [--command "..."]

Prints and writes: steps run, mean reward of the first and last 5 steps, mean step time (after the first step,
which includes start-up), engine/trainer log-prob difference (mean over steps of the per-step mean, and the
largest per-step max), and the device (`torch.cuda.get_device_name()`, else the CPU). Used by
`benchmarks/device_checks.sh` for the quickstarts it runs on a GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path


def summarize(metrics_path: Path) -> dict:
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    if not records:
        raise SystemExit(f"{metrics_path}: no steps logged")
    rewards = [r["reward/mean"] for r in records]
    later = records[1:] or records
    return {
        "steps": len(records),
        "reward_first5": sum(rewards[:5]) / len(rewards[:5]),
        "reward_last5": sum(rewards[-5:]) / len(rewards[-5:]),
        "step_s_mean_after_first": sum(r["timing/step_s"] for r in later) / len(later),
        "logprob_abs_diff_mean": sum(r["rollout/logprob_abs_diff"] for r in records) / len(records),
        "logprob_abs_diff_max": max(r["rollout/logprob_abs_diff_max"] for r in records),
        "weight_sync_s_mean": sum(r.get("timing/weight_sync_s", 0.0) for r in later) / len(later),
    }


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help="what was run, e.g. quickstart_default")
    parser.add_argument("output_dir", help="the run's output_dir (holding metrics.jsonl)")
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument("--command", default="", help="the command that made the run (recorded)")
    args = parser.parse_args(argv)
    metrics = Path(args.output_dir) / "metrics.jsonl"
    if not metrics.is_file():
        print(f"{args.name}: no {metrics} (the run did not log a step)", file=sys.stderr)
        return 1
    summary = {"name": args.name, "device": device_name(), "command": args.command, **summarize(metrics)}
    print(f"{args.name} on {summary['device']}: {summary['steps']} steps, reward {summary['reward_first5']:.3f} "
          f"(first 5) -> {summary['reward_last5']:.3f} (last 5), {summary['step_s_mean_after_first']:.2f} s a step, "
          f"engine/trainer log-prob diff {summary['logprob_abs_diff_mean']:.2e} mean")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
