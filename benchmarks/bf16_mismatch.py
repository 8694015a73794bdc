"""The train/inference mismatch of bf16 beside fp32, with rollout correction off and on, from one run.

    python benchmarks/bf16_mismatch.py [--steps 60] [--json FILE] [key=value ...]

Three quickstart runs one after the other (`rollout.engine=hf`, which serves in `model.dtype`): fp32; bf16
without rollout correction; bf16 with `actor.rollout_correction=tis`. Printed for each: the mean over the run
of `rollout/logprob_abs_diff` (|trainer log-prob - engine log-prob| per response token), `rollout/k3_kl`
(KL(engine || trainer) over the sampled tokens), the first- and last-5 rewards, and for tis the mean
importance weight. Both sides of bf16 round differently (megatron's layers vs transformers'), which is the
mismatch rollout correction is for.
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
RUNS = {
    "fp32": ["model.dtype=float32"],
    "bf16": ["model.dtype=bfloat16"],
    "bf16_tis": ["model.dtype=bfloat16", "actor.rollout_correction=tis"],
}


def run(name: str, out_dir: Path, steps: int, extra: list[str]) -> list[dict]:
    subprocess.run([sys.executable, "-m", "rl360.cli", "quickstart", f"output_dir={out_dir}",
                    f"trainer.total_steps={steps}", "trainer.save_hf=false", *RUNS[name], *extra],
                   check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def summary(records: list[dict]) -> dict[str, float]:
    def mean(key: str, rows: list[dict]) -> float:
        values = [r[key] for r in rows if key in r]
        return sum(values) / len(values) if values else float("nan")

    return {"logprob_abs_diff": mean("rollout/logprob_abs_diff", records), "k3_kl": mean("rollout/k3_kl", records),
            "first5": mean("reward/mean", records[:5]), "last5": mean("reward/mean", records[-5:]),
            "tis_mean_weight": mean("rollout_correction/mean_weight", records)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rl360-bf16-") as tmp:
        results = {name: summary(run(name, Path(tmp) / name, args.steps, args.overrides)) for name in RUNS}
    print(f"quickstart, {args.steps} steps {' '.join(args.overrides)}")
    print(f"{'run':9} {'|dlogp|':>10} {'k3 KL':>10} {'first5':>7} {'last5':>7} {'tis w':>7}")
    for name, r in results.items():
        print(f"{name:9} {r['logprob_abs_diff']:10.2e} {r['k3_kl']:10.2e} {r['first5']:7.3f} {r['last5']:7.3f} "
              f"{r['tis_mean_weight']:7.3f}")
    ratio = results["bf16"]["logprob_abs_diff"] / results["fp32"]["logprob_abs_diff"]
    print(f"bf16 / fp32 log-prob mismatch: {ratio:,.0f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": " ".join(["python benchmarks/bf16_mismatch.py", *(sys.argv[1:] if argv is None else argv)]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "steps": args.steps,
            "overrides": args.overrides, "results": results, "bf16_over_fp32_mismatch": ratio}, indent=1))


if __name__ == "__main__":
    main()
