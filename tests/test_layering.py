"""The house's floors: every rl360 module imports only rooms on lower floors (or its own room), so no two rooms
import each other and the shared types at the bottom import nothing above them. Imports are read from the source
(ast), lazy ones inside functions and `TYPE_CHECKING` blocks included.

A room is a sub-package of rl360 (`rl360/weight_sync/`) or a top-level module (`rl360/trainer.py`). A new room
gets a floor here; rooms on one floor do not import each other."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "rl360"

FLOORS = [
    ["core", "imports", "network", "errors"],  # shared types (prompts, samples, sampling params, engine kinds), the
    # engine API's client, the user-error base
    ["algos", "tracking", "service", "model_dir", "model_shapes", "stopping", "weight_sync"],  # pure torch
    # algorithms, metric sinks, the HTTP service layer, model directory checks, released models' shapes, stopping a
    # run on a signal, weights into engines (its strategies' registry)
    ["config"],  # the typed run config (validates against the algos' and weight sync's registries)
    ["data", "cluster", "installed"],  # prompts from parquet, Ray placement, what a config needs installed
    ["rewards", "actor", "engine", "checkpointing", "run_config"],  # scoring, the policy, the engines themselves,
    # checkpoints and the config saved with a run
    ["rollout", "serve", "convert", "plan", "agents", "config_docs"],  # the engine fleet and the training sampler;
    # services; tools (the config reference among them); the multi-turn agent loop and its tools (engine-agnostic:
    # it never imports rollout)
    ["eval", "quickstart", "run_checks"],  # batch evaluation against endpoints or engine servers it starts (fleet
    # engines, reward pool); the quickstarts' tiny models and tasks (primed through the agent loop and its tools);
    # a training run's checks before it starts (model directory, resume, data rows, agent)
    ["trainer", "sft", "launch", "view", "alternate"],  # the RL loop; supervised fine-tuning on the same policy; the
    # browser viewer of runs, eval outputs and parquet files; the Lewis game's phases (each a `rl360 train` subprocess)
    ["cli"],
]
FLOOR = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}


def _room(module: str) -> str | None:
    """The room of a dotted rl360 module name (None for rl360 itself and for other packages)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "rl360" and len(parts) > 1 else None


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import in a file, relative ones resolved."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from rl360 import data` names the room data
            names = {f"{base}.{alias.name}" if base == "rl360" else base for alias in node.names}
            found += [(node.lineno, module) for module in sorted(names)]
    return found


def upward_imports(root: Path = ROOT) -> list[str]:
    """Every import of a room on the same or a higher floor, as `file:line: room (floor) imports room (floor)`."""
    offences = []
    for path in sorted(root.rglob("*.py")):
        room = _room(_module_name(path, root))
        if room is None:
            continue
        for line, module in _imports(path, root):
            target = _room(module)
            if target is None or target == room:
                continue
            if FLOOR[target] >= FLOOR[room]:
                offences.append(f"{path.relative_to(root.parent)}:{line}: {room} (floor {FLOOR[room]}) imports "
                                f"{module} (floor {FLOOR[target]})")
    return offences


def test_every_room_has_a_floor():
    packages = {path.name for path in ROOT.iterdir() if (path / "__init__.py").exists()}
    rooms = packages | {path.stem for path in ROOT.glob("*.py") if path.stem != "__init__"}
    assert sorted(rooms - FLOOR.keys()) == [], "give the new room a floor in FLOORS"
    assert sorted(FLOOR.keys() - rooms) == [], "FLOORS names a room that is gone"


def test_rooms_import_only_lower_floors():
    offences = upward_imports()
    assert not offences, "imports that point up or sideways:\n" + "\n".join(offences)


def test_an_upward_import_is_named(tmp_path):
    """The check itself: a data module importing the rollout room is reported with its file and line."""
    (tmp_path / "rl360" / "data").mkdir(parents=True)
    (tmp_path / "rl360" / "__init__.py").write_text("")
    (tmp_path / "rl360" / "data" / "__init__.py").write_text("")
    (tmp_path / "rl360" / "data" / "render.py").write_text(
        "import os\nfrom rl360.core import Sample\n\ndef f():\n    from rl360.rollout.fleet import EngineFleet\n")
    (tmp_path / "rl360" / "data" / "mix.py").write_text("from .render import f\nfrom ..cluster import groups\n")
    offences = upward_imports(tmp_path / "rl360")
    assert offences == ["rl360/data/mix.py:2: data (floor 3) imports rl360.cluster (floor 3)",
                        "rl360/data/render.py:5: data (floor 3) imports rl360.rollout.fleet (floor 5)"]


@pytest.mark.parametrize("module", ["rl360.core", "rl360.weight_sync.formats"])
def test_the_lower_floors_stand_alone(module):
    """The bottom rooms import without Ray or the engines' web stack behind them."""
    import subprocess
    import sys

    code = (f"import sys, {module}; heavy = sorted(m for m in ('ray', 'fastapi', 'rl360.rollout', 'rl360.actor') "
            "if m in sys.modules); print(heavy); sys.exit(bool(heavy))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent)
    assert result.returncode == 0, result.stdout + result.stderr


MAX_FUNCTION_LINES = 80


def long_functions(root: Path = ROOT, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Every function (method, nested function) of more than `limit` lines, its decorators left out, as
    `file:line: name (N lines)`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {node.name} ({lines} lines)")
    return found


def test_no_function_is_over_80_lines():
    offences = long_functions()
    assert not offences, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(offences)


def test_a_long_function_is_named(tmp_path):
    """The check itself: a method one line over the limit is reported, one at the limit is not."""
    (tmp_path / "rl360").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    (tmp_path / "rl360" / "mod.py").write_text(
        f"def fits():\n{body}\n\nclass Step:\n    @property\n    def grows(self):\n"
        + body.replace("    ", "        ") + "        return x0\n")
    assert long_functions(tmp_path / "rl360") == [f"rl360/mod.py:{MAX_FUNCTION_LINES + 5}: grows "
                                                  f"({MAX_FUNCTION_LINES + 1} lines)"]


def test_the_layout_doc_shows_these_floors():
    """docs/layout.md's floors table names every room on the floor given here."""
    doc = (ROOT.parent / "docs" / "layout.md").read_text(encoding="utf-8")
    shown = {}
    for line in doc.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].isdigit():
            shown[int(cells[0])] = [name.strip(" `") for name in cells[1].split(",")]
    assert shown == dict(enumerate(FLOORS))


# The rooms that take the whole run config, and why; every other component builds from its own sections (or small
# settings made from them, as `SamplerSettings.of` and `PolicySettings.of` in the rooms below make them).
WHOLE_CONFIG_ROOMS = {
    "config": "defines it",
    "config_docs": "documents every key",
    "run_config": "saves it with a run and compares a resumed run's",
    "actor": "PolicySettings.of: the policy's settings from their sections",
    "rollout": "SamplerSettings.of: the sampler's settings from their sections",
    "agents": "agent_from_config: the agent loop and its tools from agent, rollout and model",
    "run_checks": "a run's checks before it starts read every section",
    "quickstart": "prepares a quickstart's model and data for its config",
    "trainer": "the RL step: hands each component its sections",
    "sft": "supervised fine-tuning's step",
}
MAX_CONFIG_DESCENT = 8  # floors between the step and the lowest room the whole config reaches


def rooms_naming(name: str, root: Path = ROOT) -> set[str]:
    """The rooms whose code names `name` (imports it, annotates with it or calls it)."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        if any(isinstance(node, ast.Name) and node.id == name or isinstance(node, ast.alias) and node.name == name
               for node in ast.walk(tree)):
            found.add(_room(_module_name(path, root)))
    return found - {None}


def test_the_whole_run_config_reaches_only_the_rooms_that_need_it():
    """A component that takes `RunConfig` whole is a deliberate choice named above; the step's config descends at
    most MAX_CONFIG_DESCENT floors."""
    rooms = rooms_naming("RunConfig")
    assert sorted(rooms - WHOLE_CONFIG_ROOMS.keys()) == [], "build these from their own sections, or name them above"
    assert sorted(WHOLE_CONFIG_ROOMS.keys() - rooms) == [], "these no longer take the whole config: drop them above"
    assert FLOOR["trainer"] - min(FLOOR[room] for room in rooms) <= MAX_CONFIG_DESCENT


def test_a_room_taking_the_whole_config_is_named(tmp_path):
    """The check itself: a module annotating with `RunConfig` (imported lazily) is found; a docstring naming it
    is not."""
    (tmp_path / "rl360" / "eval").mkdir(parents=True)
    (tmp_path / "rl360" / "data").mkdir()
    (tmp_path / "rl360" / "eval" / "during.py").write_text(
        "def at(cfg: 'x') -> None:\n    from rl360.config import RunConfig\n    return RunConfig\n")
    (tmp_path / "rl360" / "data" / "stream.py").write_text('"""Rows, not the RunConfig."""\n')
    assert rooms_naming("RunConfig", tmp_path / "rl360") == {"eval"}
