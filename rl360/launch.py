"""`rl360 launch TEMPLATE [--sbatch-option=value ...] [key=value | preset.yaml ...]`: submit a Slurm template with
`sbatch`; `--print` shows it instead.

TEMPLATE is a Slurm script (`launchers/slurm/*.sbatch`) or a run template (`configs/templates/*.yaml`), which
stands for the script that trains it (the one whose `rl360 train` line names it). After it, an argument starting
with `-` is an sbatch option, given to sbatch before the script so that it replaces the script's `#SBATCH` line
(`--partition=gpu --account=lab --time=1-00:00:00 --cpus-per-task=64`; written `--name=value`); key=value
arguments and YAML presets go on to the trainer. Before submitting, what the job needs is checked here, each
mistake one line and exit status 2: the variables the template requires (RL360_REQUIRED_ENV), the environment
(RL360_CONTAINER_IMAGE, RL360_CONDA_ENV, a conda environment that exists, or RL360_VENV) and `sbatch` itself.
The job is submitted from the repository root (the script runs there), and sbatch's own line (`Submitted batch
job N`) is printed.

`--print` submits nothing: it prints the `sbatch` command, the script, and the commands the script runs, from a
dry run (`RL360_DRY_RUN=1`: `launchers/slurm/ray_cluster.sh` prints each command, srun, ray head, ray workers,
the readiness check, the trainer, instead of running it) on made-up nodes `node-01 ...`, as many as its
`#SBATCH --nodes`. Variables the template requires and the user has not set are shown as `<NAME>`; so is the
environment (a conda one) when none is set.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from rl360.errors import UserError

REPO = Path(__file__).resolve().parent.parent
SLURM_DIR = REPO / "launchers" / "slurm"
_TRAIN_LINE = re.compile(r"rl360 train (\S+\.ya?ml)")


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


def script_for(template: Path) -> Path:
    """The Slurm script of `template`: itself when it is one, else the script of launchers/slurm/ whose
    `rl360 train` line names it (a UserError when it is neither)."""
    if not template.is_file():
        raise UserError(f"no file at {template}; templates: {_listing()}")
    if template.suffix not in (".yaml", ".yml"):
        return template
    for script in sorted(SLURM_DIR.glob("*.sbatch")):
        for named in _TRAIN_LINE.findall(script.read_text()):
            if (REPO / named).resolve() == template.resolve():
                return script
    raise UserError(f"no Slurm script in {SLURM_DIR.relative_to(REPO)}/ trains {template} (a "
                    f"script there runs `rl360 train {template}`); templates: {_listing()}")


def dry_run(template: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    text = template.read_text()
    nodes = int(sbatch_options(text).get("nodes", "1"))
    env = {**os.environ, "RL360_DRY_RUN": "1", "SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_ID": "dry-run",
           "RL360_NODES": " ".join(f"node-{i:02d}" for i in range(1, nodes + 1))}
    for name in required_env(text):
        env.setdefault(name, f"<{name}>")
    if not env.get("RL360_CONTAINER_IMAGE") and not env.get("RL360_CONDA_ENV") and not env.get("RL360_VENV"):
        env.update(RL360_CONDA_ENV="<RL360_CONDA_ENV>", RL360_CONDA_SH="<conda>/etc/profile.d/conda.sh")
    with tempfile.TemporaryDirectory(prefix="rl360-launch-") as logs:
        env["RL360_LOG_DIR"] = logs
        return subprocess.run(["bash", str(template), *overrides], env=env, cwd=REPO, capture_output=True, text=True)


def check_submission(script: Path, environ: dict[str, str]) -> None:
    """What the job needs, checked before it is queued (a UserError naming the first thing missing)."""
    for name in required_env(script.read_text()):
        value = environ.get(name, "")
        if not value:
            raise UserError(f"{name} is not set ({script.name} needs: "
                            f"{' '.join(required_env(script.read_text()))})")
        if name.endswith(("_PATH", "_DIR")) and not Path(value).exists():
            raise UserError(f"{name}={value} does not exist")
    chosen = [name for name in ("RL360_CONTAINER_IMAGE", "RL360_CONDA_ENV", "RL360_VENV") if environ.get(name)]
    if len(chosen) != 1:
        raise UserError("set one of RL360_CONTAINER_IMAGE (a pyxis/enroot image, docker/README.md), "
                        "RL360_CONDA_ENV (a conda environment, launchers/conda) and RL360_VENV (a virtualenv every "
                        f"node sees){'; set: ' + ', '.join(chosen) if chosen else ''}")
    if chosen == ["RL360_CONDA_ENV"]:
        _check_conda_env(environ["RL360_CONDA_ENV"], environ)
    if chosen == ["RL360_VENV"] and not (Path(environ["RL360_VENV"]) / "bin" / "activate").is_file():
        raise UserError(f"RL360_VENV={environ['RL360_VENV']} is not a virtualenv (no bin/activate)")
    if shutil.which("sbatch", path=environ.get("PATH")) is None:
        raise UserError("sbatch is not on PATH: submit from a Slurm login node, or `rl360 launch "
                        "--print TEMPLATE` shows the job without submitting it")


def _check_conda_env(name: str, environ: dict[str, str]) -> None:
    conda = shutil.which("conda", path=environ.get("PATH"))
    if conda is None:
        raise UserError(f"RL360_CONDA_ENV={name}, but conda is not on PATH here")
    listed = subprocess.run([conda, "env", "list", "--json"], capture_output=True, text=True, env=environ)
    try:
        envs = [Path(path) for path in json.loads(listed.stdout)["envs"]]
    except (ValueError, KeyError):
        raise UserError(f"`conda env list --json` failed: {listed.stderr.strip()}") from None
    if name not in {path.name for path in envs} and Path(name) not in envs:
        raise UserError(f"RL360_CONDA_ENV={name}: no such conda environment (conda has: "
                        f"{', '.join(path.name for path in envs) or 'none'}); launchers/conda/install.sh makes one")


def add_launch_parser(commands) -> None:
    parser = commands.add_parser("launch", help="submit a Slurm template with sbatch (--print: show it instead)")
    parser.add_argument("--print", dest="print_only", action="store_true",
                        help="print the sbatch command, the script and every command it runs; submit nothing")
    parser.add_argument("template", help="a launchers/slurm/*.sbatch script or a configs/templates/*.yaml run")
    parser.add_argument("arguments", nargs=argparse.REMAINDER,
                        help="sbatch options (--name=value: they replace the script's #SBATCH lines), then key=value "
                             "overrides and YAML presets passed on to the trainer")
    parser.set_defaults(run=_run)


def split_arguments(arguments: list[str]) -> tuple[list[str], list[str], bool]:
    """(sbatch options, the trainer's arguments, --print) from what follows the template; a word that is neither
    an option, a key=value nor a YAML file (the value of `-p gpu`) is a UserError saying how to write it."""
    options, trainer, print_only = [], [], False
    for argument in arguments:
        if argument == "--print":
            print_only = True
        elif argument.startswith("-"):
            options.append(argument)
        elif "=" in argument or argument.endswith((".yaml", ".yml")):
            trainer.append(argument)
        else:
            after = f" (after {options[-1]})" if options else ""
            raise UserError(f"rl360 launch: {argument!r}{after} is neither a key=value override nor a YAML preset; "
                            "give sbatch options as --name=value (--partition=gpu, not -p gpu)")
    return options, trainer, print_only


def _run(args: argparse.Namespace) -> int:
    script = script_for(Path(args.template))
    options, overrides, print_only = split_arguments(args.arguments)
    command = ["sbatch", *options, str(script.resolve().relative_to(REPO) if script.resolve().is_relative_to(REPO)
                                       else script.resolve()), *overrides]
    if args.print_only or print_only:
        return _print(script, command, overrides)
    check_submission(script, dict(os.environ))
    (REPO / "logs").mkdir(exist_ok=True)  # sbatch does not make the directory of #SBATCH --output
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"sbatch refused the job (status {done.returncode}): "
                        f"{' '.join(done.stderr.split()) or 'no message'}")
    sys.stdout.write(done.stdout)
    return 0


def _print(script: Path, command: list[str], overrides: list[str]) -> int:
    text = script.read_text()
    nodes = int(sbatch_options(text).get("nodes", "1"))
    print(f"# {shlex.join(command)}   (from {REPO})")
    print(f"# ---- {script.name} ----")
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    print(f"# ---- what it runs, on {nodes} made-up node(s) node-01 ... ----")
    result = dry_run(script, overrides)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


def _listing() -> str:
    return ", ".join(f"configs/templates/{script.stem}.yaml" for script in sorted(SLURM_DIR.glob("*.sbatch")))
