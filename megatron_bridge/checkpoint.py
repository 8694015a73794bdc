"""Megatron distributed checkpoints (megatron-core `dist_checkpointing`), loadable at any TP x PP layout.

A checkpoint directory holds megatron-core's sharded files plus `hf/`: the source model's config.json and
tokenizer files, so the bridge that built the model can be rebuilt from the checkpoint alone, and
`rl360.json` recording the layout and dtype it was saved at. Every rank calls `save` and `load`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_bridge.bridge import TOKENIZER_FILES, Bridge, _unwrap

HF_SUBDIR = "hf"
META_FILE = "rl360.json"
EXTRA_STATE = "_extra_state"  # torch's key of a module's get_extra_state() (Transformer Engine: fp8 metadata)


def save_checkpoint(bridge: Bridge, models: list, ckpt_dir: str | Path) -> Path:
    """Save this rank's shards of `models` (all ranks together write the whole model) into `ckpt_dir`."""
    from megatron.core import dist_checkpointing, parallel_state

    out = Path(ckpt_dir)
    if not dist.is_initialized() or dist.get_rank() == 0:
        if out.exists() and any(out.iterdir()):
            raise FileExistsError(f"{out} is not empty: refusing to mix two checkpoints")
        write_checkpoint_info(out, bridge, parallel_state.get_tensor_model_parallel_world_size(),
                              parallel_state.get_pipeline_model_parallel_world_size(),
                              str(next(_unwrap(models[0]).parameters()).dtype).removeprefix("torch."))
    if dist.is_initialized():
        dist.barrier()
    dist_checkpointing.save(_sharded_state_dict(models), str(out))
    return out


def write_checkpoint_info(ckpt_dir: str | Path, bridge: Bridge, tensor_parallel: int, pipeline_parallel: int,
                          dtype: str, model_state_key: str | None = None) -> None:
    """Write `hf/` (the config.json and tokenizer files of the model `bridge` was built from) and `rl360.json`
    (layout, vocabulary padding, dtype and, when the saved state holds more than the model, the key of the
    model's weights in it) into `ckpt_dir`: what rebuilds the model around its saved weights."""
    out = Path(ckpt_dir)
    (out / HF_SUBDIR).mkdir(parents=True)
    (out / HF_SUBDIR / "config.json").write_text(json.dumps(bridge.hf_config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (bridge.hf_dir / name).is_file():
            shutil.copy2(bridge.hf_dir / name, out / HF_SUBDIR / name)
    meta = {"format": "megatron-core dist_checkpointing", "tensor_parallel": tensor_parallel,
            "pipeline_parallel": pipeline_parallel, "vocab_divisible_by": bridge.vocab_divisible_by, "dtype": dtype}
    if model_state_key is not None:
        meta["model_state_key"] = model_state_key
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def checkpoint_bridge(ckpt_dir: str | Path) -> Bridge:
    """The bridge of the model saved in `ckpt_dir` (from its `hf/` config and its recorded vocab padding)."""
    ckpt = Path(ckpt_dir)
    meta_path = ckpt / META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} not found: not a checkpoint written by rl360 / megatron_bridge")
    meta = json.loads(meta_path.read_text())
    return Bridge.from_hf_pretrained(ckpt / HF_SUBDIR, vocab_divisible_by=meta["vocab_divisible_by"])


def checkpoint_dtype(ckpt_dir: str | Path) -> torch.dtype:
    return getattr(torch, json.loads((Path(ckpt_dir) / META_FILE).read_text())["dtype"])


def load_checkpoint(models: list, ckpt_dir: str | Path) -> None:
    """Load `ckpt_dir` into this rank's `models`, whatever TP x PP layout and layer spec saved it."""
    load_model_state(_unwrap(models[0]), load_sharded(_sharded_state_dict(models), ckpt_dir))


def load_sharded(sharded_state_dict: dict, ckpt_dir: str | Path) -> dict:
    """`dist_checkpointing.load`, allowing the one difference a checkpoint of another layer spec shows (the
    specs' parameters save under the same keys, see `megatron_bridge.layer_spec`): Transformer Engine's core
    attention and norms add `_extra_state` entries (fp8 metadata, empty without fp8) that a checkpoint saved from
    the torch or local spec lacks. Those are left out of the load and the modules keep their own; any other entry
    the checkpoint lacks is an error naming it. (A TE checkpoint's extra entries are simply not read by the
    torch spec.)"""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    state, _, absent = dist_checkpointing.load(sharded_state_dict, str(ckpt_dir),
                                               strict=StrictHandling.RETURN_UNEXPECTED)
    wrong = sorted(key for key in absent if not key.endswith(EXTRA_STATE))
    if wrong:
        raise KeyError(f"{ckpt_dir} lacks {wrong[:8]}{f' and {len(wrong) - 8} more' if len(wrong) > 8 else ''}")
    return state


def load_model_state(model: torch.nn.Module, state: dict) -> None:
    """`model.load_state_dict(state)`, strict except for `_extra_state` entries: those `load_sharded` left out, and
    the one of TE's core attention, which its `sharded_state_dict` never saves (megatron-core 0.16.1
    `TEDotProductAttention.sharded_state_dict`: only a learnable softmax offset), so no checkpoint holds it."""
    result = model.load_state_dict(state, strict=False)
    missing, unexpected = ([key for key in sorted(keys) if not key.endswith(EXTRA_STATE)]
                           for keys in (result.missing_keys, result.unexpected_keys))
    if missing or unexpected:
        raise KeyError(f"the checkpoint's state and the model disagree: missing {missing}, unexpected {unexpected}")


def _sharded_state_dict(models: list) -> dict:
    if len(models) != 1:
        raise ValueError(f"expected one model chunk per rank (no virtual pipeline stages), got {len(models)}")
    return _unwrap(models[0]).sharded_state_dict()
