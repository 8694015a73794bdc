"""Create a quickstart's model directory and parquet task where the config points, if absent.

Tasks: `arithmetic` (a tiny Qwen2 learns single-digit addition), `vision` (a tiny Qwen2.5-VL learns which colour
fills most of an image), `vision-control` (the same with every image a plain grey square: nothing to learn),
`tools` (a tiny Qwen2 learns to call the python tool for `a*b%7` of 6-digit numbers and copy its answer),
`tools-control` (the same task with the agent loop off: only guessing), `zoom` (a tiny Qwen2.5-VL reads a mark
legible only in the `image_zoom_in_tool` crop) and `zoom-control` (the same without the tool). The `lewis` task's
two agents and games: `prepare_lewis_quickstart`."""

from __future__ import annotations

import importlib
from pathlib import Path

from rl360.config import RunConfig

REPO = Path(__file__).resolve().parents[2]
TASKS = ("arithmetic", "vision", "vision-control", "tools", "tools-control", "zoom", "zoom-control")


def prepare_quickstart(cfg: RunConfig, task: str = "arithmetic") -> None:
    if task not in TASKS:
        raise ValueError(f"quickstart task {task!r}: choose one of {TASKS}")
    model_dir = Path(cfg.model.path)
    vision = task.startswith(("vision", "zoom"))
    zoom, tools = task.startswith("zoom"), task.startswith("tools")
    if not (model_dir / "config.json").exists():
        if zoom:
            from rl360.quickstart.zoom_assets import build_zoom_quickstart_model

            build_zoom_quickstart_model(cfg, _script("synthetic_zoom"))
            print(f"built a random-weight tiny Qwen2.5-VL model (the zoom call one token, written first in about "
                  f"half its replies; a crop's colour read right about 40% of the time), its tokenizer and image "
                  f"processor in {model_dir}")
        elif tools:
            _build_tools_model(cfg)
        elif vision:
            from rl360.quickstart.vision_assets import build_vision_quickstart_model

            build_vision_quickstart_model(model_dir, texts=[_script("synthetic_colours").QUESTION], seed=cfg.seed)
            print(f"built a random-weight tiny Qwen2.5-VL model, its tokenizer and image processor in {model_dir}")
        else:
            from rl360.quickstart.assets import build_quickstart_model

            build_quickstart_model(model_dir, seed=cfg.seed)
            print(f"built a random-weight tiny Qwen2 model and its tokenizer in {model_dir}")
    data_files = [Path(f) for f in cfg.data.train_files + cfg.data.val_files]  # the scripts write both splits
    if not all(f.exists() for f in data_files):
        out_dir = str(data_files[0].parent)
        if zoom:
            _script("synthetic_zoom").main(["--out", out_dir])
        elif tools:
            _script("synthetic_tools").main(["--out", out_dir])
        elif vision:
            _script("synthetic_colours").main(["--out", out_dir] + (["--blank"] if task == "vision-control" else []))
        else:
            _script("synthetic_arithmetic").main(["--out", out_dir])


def _build_tools_model(cfg: RunConfig) -> None:
    from rl360.quickstart.tools_assets import build_tools_quickstart_model

    model_dir = Path(cfg.model.path)
    rows = _script("synthetic_tools").make_rows(512, "prime", seed=cfg.seed + 2)
    build_tools_quickstart_model(model_dir, [row["prompt"][0]["content"] for row in rows],
                                 [row["reward_model"]["ground_truth"] for row in rows], seed=cfg.seed)
    print(f"built a random-weight tiny Qwen2 model and its tokenizer (one token per tool call, written first "
          f"in about half its replies; a tool's printed answer repeated about 40% of the time) in {model_dir}")


def prepare_sft_quickstart(cfg: RunConfig) -> None:
    """`rl360 quickstart --task sft`: the tools quickstart's model (as `--task tools` builds it) and traces of its
    task (`data_preprocess/synthetic_tools.py --traces`: 1024 conversations to train on, 64 held out) where the
    config points, if absent."""
    if not (Path(cfg.model.path) / "config.json").exists():
        _build_tools_model(cfg)
    files = [Path(f) for f in cfg.data.train_files + cfg.data.val_files]
    if not all(f.exists() for f in files):
        _script("synthetic_tools").main(["--out", str(files[0].parent), "--traces", "--train-rows", "1024",
                                         "--test-rows", "64", "--seed", str(cfg.seed)])


def _script(name: str):
    """data_preprocess/NAME.py (scripts beside the package, not part of it)."""
    import sys

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module(f"data_preprocess.{name}")


def prepare_lewis_quickstart(speaker: RunConfig, listener: RunConfig) -> None:
    """The Lewis game's tiny speaker (Qwen2.5-VL) and listener (text Qwen2) and its games (coloured shapes,
    `data_preprocess/lewis/synthetic_shapes.py`: speaker.parquet, listener.parquet and the images) where the two
    configs point, if absent."""
    from rl360.quickstart.lewis_assets import build_listener, build_speaker

    shapes = _script("lewis.synthetic_shapes")
    colours, kinds = list(shapes.COLOURS), list(shapes.SHAPES)
    if not (Path(speaker.model.path) / "config.json").exists():
        import random

        image = shapes.draw_shape(colours[0], kinds[0], random.Random(speaker.seed))
        build_speaker(speaker.model.path, shapes.INSTRUCTION, colours, kinds, image, seed=speaker.seed)
        print(f"built a random-weight tiny Qwen2.5-VL speaker (each colour word primed as its first token) in "
              f"{speaker.model.path}")
    if not (Path(listener.model.path) / "config.json").exists():
        build_listener(listener.model.path, colours, kinds, seed=listener.seed)
        print(f"built a random-weight tiny Qwen2 listener (\"Yes\" primed as its first token) in {listener.model.path}")
    files = [Path(f) for f in (*speaker.data.train_files, *listener.data.train_files)]
    if not all(f.exists() for f in files):
        shapes.main(["--out", str(files[0].parent), "--seed", str(speaker.seed)])
