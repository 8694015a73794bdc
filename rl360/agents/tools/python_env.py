"""An interpreter for the `python` tool that the sandbox can run and that has the image libraries PyVision's code
uses (PIL, numpy, matplotlib).

The sandbox runs code as a uid of its own (`rl360.rewards.sandbox`), so it can only start an interpreter that
uid may read: `sandbox_python()` picks this one when it can, else the system's `python3`, which often lacks
PIL. Then `image_clue_0`, ... are not loaded and nothing the cell shows comes back. This module makes a virtual
environment of the interpreter the sandbox runs, at a directory everyone may read (not under /root, not under
/tmp, which the sandbox replaces with its own), and copies into it the installed files of the packages asked for
and of what they require, from this Python's environment: nothing is downloaded. The two interpreters must be
the same Python version with the same extension-module suffix (their compiled files are shared); else it stops,
saying so, and a `pip install` into the environment does instead.

    python -m rl360.agents.tools.python_env /opt/rl360-tool-python
    # then agent.python=/opt/rl360-tool-python/bin/python
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from packaging.requirements import Requirement

IMAGE_PACKAGES = ("pillow", "numpy", "matplotlib")
IMAGE_MODULES = ("PIL", "numpy", "matplotlib")
_ABI = ("import json, sys, sysconfig; "
        "print(json.dumps([list(sys.version_info[:2]), sysconfig.get_config_var('EXT_SUFFIX')]))")


def requirement_closure(names: tuple[str, ...] | list[str]) -> list[metadata.Distribution]:
    """The installed distributions `names` and, recursively, those they require (extras left out)."""
    found: dict[str, metadata.Distribution] = {}
    pending = list(names)
    while pending:
        name = pending.pop()
        key = name.lower().replace("_", "-")
        if key in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise ValueError(f"{name} is not installed in {sys.prefix}: pip install {name} here first") from None
        found[key] = dist
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return list(found.values())


def make_tool_python(dest: str | os.PathLike, packages: tuple[str, ...] = IMAGE_PACKAGES,
                     base: str | None = None) -> Path:
    """A virtual environment at `dest` of `base` (default: the interpreter the sandbox runs) holding `packages`
    copied from this environment; returns its interpreter. `ValueError` when `base` is another Python version or
    ABI than this one, or a package is not installed here."""
    from rl360.rewards.sandbox import sandbox_python

    base = base or sandbox_python()
    if base is None:
        raise ValueError("no Python interpreter runs inside the sandbox here")
    theirs = json.loads(subprocess.run([base, "-I", "-c", _ABI], capture_output=True, text=True, check=True).stdout)
    ours = [list(sys.version_info[:2]), sysconfig.get_config_var("EXT_SUFFIX")]
    if theirs != ours:
        raise ValueError(f"{base} is Python {theirs[0]} ({theirs[1]}), this is {ours[0]} ({ours[1]}): their "
                         f"compiled packages differ; make the environment with `{base} -m venv {dest}` and pip "
                         f"install {' '.join(packages)} into it")
    dest = Path(dest).resolve()
    _reachable(dest)
    subprocess.run([base, "-m", "venv", "--without-pip", "--clear", str(dest)], check=True)
    site = Path(subprocess.run([str(dest / "bin" / "python"), "-I", "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for dist in requirement_closure(packages):
        root = Path(dist.locate_file("")).resolve()
        for file in dist.files or []:
            source = Path(dist.locate_file(file)).resolve()
            if not source.is_file() or root not in source.parents:  # scripts and data outside site-packages
                continue
            target = site / source.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    _readable(dest)
    return dest / "bin" / "python"


def missing_modules(python: str, modules: tuple[str, ...] = IMAGE_MODULES) -> list[str]:
    """The `modules` that `python` cannot import when the sandbox runs it (all of them when it cannot run)."""
    from rl360.rewards.sandbox import SandboxLimits, run_command

    probe = ("import importlib.util, json\n"
             f"print(json.dumps([m for m in {list(modules)!r} if importlib.util.find_spec(m) is None]))")
    result = run_command([python, "-I", "-c", probe], limits=SandboxLimits(timeout_s=60.0))
    try:
        return json.loads(result.stdout.strip().splitlines()[-1]) if result.returncode == 0 else list(modules)
    except (IndexError, ValueError):
        return list(modules)


def _readable(root: Path) -> None:
    """Everyone may read the tree and enter its directories (the sandbox's uid among them)."""
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        path.chmod(mode | 0o444 | (0o111 if path.is_dir() else 0))


def _reachable(root: Path) -> None:
    """`ValueError` when the sandbox could not reach `root`: a parent closed to other users, or under /tmp."""
    if root.is_relative_to("/tmp") or root.is_relative_to("/var/tmp") or root.is_relative_to("/dev/shm"):
        raise ValueError(f"{root}: the sandbox has a /tmp, /var/tmp and /dev/shm of its own; choose another directory")
    for parent in root.parents:
        if parent.exists() and not parent.stat().st_mode & 0o001:
            raise ValueError(f"{parent} is closed to other users, so the sandbox cannot reach {root}: choose a "
                             "directory outside it")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", help="the environment's directory (readable by everyone, not under /tmp)")
    parser.add_argument("--packages", nargs="*", default=list(IMAGE_PACKAGES), help="distributions to copy")
    args = parser.parse_args(argv)
    python = make_tool_python(args.dest, tuple(args.packages))
    missing = missing_modules(str(python))
    print(f"{python}: set agent.python={python}" + (f" (the sandbox cannot import {missing})" if missing else ""))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
