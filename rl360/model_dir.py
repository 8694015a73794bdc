"""The check of a Hugging Face model directory before anything loads it (`check_model_dir`).

rl360 reads models from local directories only: config.json, the weights (*.safetensors or *.bin, or an index
naming its shards) and, where text is generated or rendered, a tokenizer (tokenizer.json, or tokenizer_config.json
with a vocabulary). A missing piece is a `ModelDirError` naming the directory and the piece, raised in
milliseconds, instead of a transformers error (or a wait on the network for a hub id) later.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from rl360.errors import UserError

WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# files that, beside tokenizer_config.json, hold a slow tokenizer's vocabulary
VOCAB_FILES = ("vocab.json", "tokenizer.model", "vocab.txt", "spiece.model", "sentencepiece.bpe.model",
               "qwen.tiktoken", "tiktoken.model")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelDirError(UserError):
    """A model directory is missing or lacks a file a model needs; the message names it and what to do."""


def check_model_dir(path: str | Path, key: str = "model.path", tokenizer: bool = True) -> Path:
    """`path` as a Path when it is a model directory rl360 can load; else `ModelDirError` that names `key` (the
    setting or flag that gave it), the directory and what is missing. `tokenizer=False` skips the tokenizer
    (checkpoint conversion reads weights alone)."""
    text = str(path)
    path = Path(path)
    where = f"{key}={text}"
    if not path.exists():
        if "quickstart_assets" in path.parts:
            raise ModelDirError(f"{where} does not exist yet: run `rl360 quickstart` first, which builds the "
                                "quickstart's model and data (then `rl360 train` can use them)")
        if _HUB_ID.match(text):
            raise ModelDirError(f"{where}: no such directory, and rl360 does not download models: it takes a local "
                                f"directory. Download it first, e.g. `huggingface-cli download {text} --local-dir "
                                f"models/{text.split('/')[-1]}`, and set {key} to that directory")
        raise ModelDirError(f"{where}: no such directory (a local Hugging Face model directory is needed)")
    if not path.is_dir():
        raise ModelDirError(f"{where} is a file; give the Hugging Face model directory that holds it")
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    missing += _missing_weights(path)
    if tokenizer and not _has_tokenizer(path):
        missing.append("a tokenizer (tokenizer.json, or tokenizer_config.json with its vocabulary files)")
    if missing:
        raise ModelDirError(f"{where} is not a complete Hugging Face model directory: it lacks "
                            f"{'; '.join(missing)}")
    return path


def _missing_weights(path: Path) -> list[str]:
    """What is missing of the weights: nothing when an index names shards that are all there, or when a
    *.safetensors or *.bin file is there."""
    for name in WEIGHT_INDEXES:
        index = path / name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError):
                return [f"a readable {name} (it has no weight_map)"]
            absent = [shard for shard in shards if not (path / shard).is_file()]
            if absent:
                more = f" and {len(absent) - 3} more" if len(absent) > 3 else ""
                return [f"weight shards that {name} names: {', '.join(absent[:3])}{more}"]
            return []
    if any(path.glob("*.safetensors")) or any(item.name != "training_args.bin" for item in path.glob("*.bin")):
        return []
    return ["weights (*.safetensors or *.bin files, or an index naming them)"]


def _has_tokenizer(path: Path) -> bool:
    if (path / "tokenizer.json").is_file():
        return True
    return (path / "tokenizer_config.json").is_file() and any((path / name).is_file() for name in VOCAB_FILES)
