"""Step time of async rollouts (step k+1 generated while step k trains) beside sync rollouts, one run each.

    python benchmarks/async_rollout.py [--steps 60] [--engine server] [key=value ...]

Both runs train `configs/quickstart.yaml` with the same settings but `rollout.mode`, each in its own process,
one after the other; the table gives the mean `timing/step_s` over the steps after the first 10 (start-up
excluded), the time each step waited for its rollouts, the first- and last-5 rewards, and async / sync.
Extra `key=value` arguments go to both runs (e.g. `rollout.max_response_length=16` for a generation-heavy
step, where overlapping pays most).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(mode: str, out_dir: Path, steps: int, engine: str, extra: list[str]) -> list[dict]:
    subprocess.run([sys.executable, "-m", "rl360.cli", "quickstart", f"output_dir={out_dir}",
                    f"trainer.total_steps={steps}", "trainer.save_hf=false", f"rollout.engine={engine}",
                    f"rollout.mode={mode}", *extra], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def summary(records: list[dict], skip: int = 10) -> dict[str, float]:
    timed = records[skip:] or records

    def mean(key: str, rows: list[dict]) -> float:
        return sum(r[key] for r in rows) / len(rows)

    return {"step_s": mean("timing/step_s", timed), "rollout_wait_s": mean("timing/rollout_wait_s", timed),
            "update_s": mean("timing/update_s", timed), "first5": mean("reward/mean", records[:5]),
            "last5": mean("reward/mean", records[-5:])}


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--engine", default="server", choices=("hf", "server"))
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rl360-async-") as tmp:
        results = {mode: summary(run(mode, Path(tmp) / mode, args.steps, args.engine, args.overrides))
                   for mode in ("sync", "async")}
    print(f"quickstart, {args.steps} steps, rollout.engine={args.engine} {' '.join(args.overrides)}")
    print(f"{'mode':6} {'step s':>8} {'waits s':>8} {'update s':>9} {'first5':>7} {'last5':>7}")
    for mode, r in results.items():
        print(f"{mode:6} {r['step_s']:8.3f} {r['rollout_wait_s']:8.3f} {r['update_s']:9.3f} {r['first5']:7.3f} "
              f"{r['last5']:7.3f}")
    ratio = results["async"]["step_s"] / results["sync"]["step_s"]
    print(f"async / sync step time: {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": " ".join(["python benchmarks/async_rollout.py", *(sys.argv[1:] if argv is None else argv)]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {'CUDA' if _has_cuda() else 'no GPU'}",
            "steps": args.steps, "engine": args.engine, "overrides": args.overrides, "results": results,
            "async_over_sync": ratio}, indent=1))


if __name__ == "__main__":
    main()
