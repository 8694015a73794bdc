"""Step time of async rollouts (the next steps generated while step k trains) beside sync rollouts, one run each.

    python benchmarks/async_rollout.py [--steps 60] [--engine server] [--variants sync,async,...] [key=value ...]

Every run trains `configs/quickstart.yaml` with the same settings but the rollout mode, each in its own process,
one after the other: `sync`; `async` (one step ahead, a weight update waits for requests in flight); `async2`
(`rollout.max_staleness=2`); `partial` (`rollout.partial=true`: a weight update aborts requests in flight and
they go on under the new weights; server engines only). The table gives the mean `timing/step_s` over the steps
after the first 10 (start-up excluded), the time each step waited for its rollouts, the first- and last-5
rewards, the responses cut by an update per step, and each run's step time over sync's. Extra `key=value`
arguments go to every run (e.g. `rollout.max_response_length=16` for a generation-heavy step, where
overlapping pays most).
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


VARIANTS = {
    "sync": ["rollout.mode=sync"],
    "async": ["rollout.mode=async"],
    "async2": ["rollout.mode=async", "rollout.max_staleness=2"],
    "partial": ["rollout.mode=async", "rollout.partial=true"],
}


def run(variant: str, out_dir: Path, steps: int, engine: str, extra: list[str]) -> list[dict]:
    subprocess.run([sys.executable, "-m", "rl360.cli", "quickstart", f"output_dir={out_dir}",
                    f"trainer.total_steps={steps}", "trainer.save_hf=false", f"rollout.engine={engine}",
                    *VARIANTS[variant], *extra], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def summary(records: list[dict], skip: int = 10) -> dict[str, float]:
    timed = records[skip:] or records

    def mean(key: str, rows: list[dict]) -> float:
        return sum(r[key] for r in rows) / len(rows)

    return {"step_s": mean("timing/step_s", timed), "rollout_wait_s": mean("timing/rollout_wait_s", timed),
            "update_s": mean("timing/update_s", timed), "first5": mean("reward/mean", records[:5]),
            "last5": mean("reward/mean", records[-5:]), "aborted": mean("rollout/aborted", records),
            "staleness_max": max(r["rollout/staleness_max"] for r in records)}


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--engine", default="server", choices=("hf", "server"))
    parser.add_argument("--variants", default="sync,async,async2,partial",
                        help=f"comma-separated, sync first; of {', '.join(VARIANTS)}")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    if variants[0] != "sync" or not set(variants) <= set(VARIANTS):
        parser.error(f"--variants must start with sync and name only {', '.join(VARIANTS)}")
    if args.engine == "hf" and "partial" in variants:
        parser.error("partial needs --engine server")
    with tempfile.TemporaryDirectory(prefix="rl360-async-") as tmp:
        results = {name: summary(run(name, Path(tmp) / name, args.steps, args.engine, args.overrides))
                   for name in variants}
    for r in results.values():
        r["over_sync"] = r["step_s"] / results["sync"]["step_s"]
    print(f"quickstart, {args.steps} steps, rollout.engine={args.engine} {' '.join(args.overrides)}")
    print(f"{'run':8} {'step s':>8} {'waits s':>8} {'update s':>9} {'first5':>7} {'last5':>7} {'cut/step':>8} "
          f"{'stale':>5} {'vs sync':>8}")
    for name, r in results.items():
        print(f"{name:8} {r['step_s']:8.3f} {r['rollout_wait_s']:8.3f} {r['update_s']:9.3f} {r['first5']:7.3f} "
              f"{r['last5']:7.3f} {r['aborted']:8.1f} {r['staleness_max']:5.0f} {r['over_sync']:7.2f}x")
    ratio = results["async"]["over_sync"] if "async" in results else None
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": " ".join(["python benchmarks/async_rollout.py", *(sys.argv[1:] if argv is None else argv)]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {'CUDA' if _has_cuda() else 'no GPU'}",
            "steps": args.steps, "engine": args.engine, "overrides": args.overrides, "results": results,
            "async_over_sync": ratio}, indent=1))


if __name__ == "__main__":
    main()
