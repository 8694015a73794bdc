"""Create the quickstart's model directory and parquet task where the config points, if absent."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rl360.config import RunConfig
from rl360.quickstart.assets import build_quickstart_model

REPO = Path(__file__).resolve().parents[2]


def prepare_quickstart(cfg: RunConfig) -> None:
    model_dir = Path(cfg.model.path)
    if not (model_dir / "config.json").exists():
        build_quickstart_model(model_dir, seed=cfg.seed)
        print(f"built a random-weight tiny Qwen2 model and its tokenizer in {model_dir}")
    data_files = [Path(f) for f in cfg.data.train_files]
    if not all(f.exists() for f in data_files):
        out_dir = data_files[0].parent
        _synthetic_arithmetic().main(["--out", str(out_dir)])


def _synthetic_arithmetic():
    """data_preprocess/synthetic_arithmetic.py (a script beside the package, not part of it)."""
    path = REPO / "data_preprocess" / "synthetic_arithmetic.py"
    spec = importlib.util.spec_from_file_location("synthetic_arithmetic", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
