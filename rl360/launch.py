"""`rl360 launch --print TEMPLATE [key=value ...]`: what a Slurm template will run, without a cluster.

The template itself runs, as `sbatch` would run it, with `RL360_DRY_RUN=1`: `launchers/slurm/ray_cluster.sh`
then prints each command (srun, ray head, ray workers, the readiness check, the trainer) instead of running it,
for made-up nodes `node-01 ...` as many as its `#SBATCH --nodes`. Variables the template requires and the user
has not set are shown as `<NAME>`; so is the environment (a conda one) when neither RL360_CONTAINER_IMAGE nor
RL360_CONDA_ENV is set.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def sbatch_options(text: str) -> dict[str, str]:
    """`#SBATCH --key=value` (or `--key value`) lines of a template."""
    options = {}
    for line in text.splitlines():
        found = re.match(r"#SBATCH\s+--([\w-]+)(?:[=\s]+(\S+))?", line)
        if found:
            options[found.group(1)] = found.group(2) or ""
    return options


def required_env(text: str) -> list[str]:
    found = re.search(r'RL360_REQUIRED_ENV="([^"]*)"', text)
    return found.group(1).split() if found else []


def dry_run(template: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    text = template.read_text()
    nodes = int(sbatch_options(text).get("nodes", "1"))
    repo = template.resolve().parents[2]
    env = {**os.environ, "RL360_DRY_RUN": "1", "SLURM_SUBMIT_DIR": str(repo), "SLURM_JOB_ID": "dry-run",
           "RL360_NODES": " ".join(f"node-{i:02d}" for i in range(1, nodes + 1))}
    for name in required_env(text):
        env.setdefault(name, f"<{name}>")
    if not env.get("RL360_CONTAINER_IMAGE") and not env.get("RL360_CONDA_ENV"):
        env.update(RL360_CONDA_ENV="<RL360_CONDA_ENV>", RL360_CONDA_SH="<conda>/etc/profile.d/conda.sh")
    with tempfile.TemporaryDirectory(prefix="rl360-launch-") as logs:
        env["RL360_LOG_DIR"] = logs
        return subprocess.run(["bash", str(template), *overrides], env=env, cwd=repo, capture_output=True, text=True)


def add_launch_parser(commands) -> None:
    parser = commands.add_parser("launch", help="print the commands a Slurm template runs (no cluster needed)")
    parser.add_argument("--print", dest="print_only", action="store_true", required=True,
                        help="print the commands (the only mode: submit the template itself with sbatch)")
    parser.add_argument("template", help="a launchers/slurm/*.sbatch file")
    parser.add_argument("overrides", nargs="*", help="key=value arguments passed on to the trainer")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    template = Path(args.template)
    if not template.is_file():
        print(f"rl360 launch: no template at {template}", file=sys.stderr)
        return 2
    options = sbatch_options(template.read_text())
    print("# sbatch " + " ".join(f"--{key}={value}" if value else f"--{key}" for key, value in options.items()))
    result = dry_run(template, args.overrides)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode
