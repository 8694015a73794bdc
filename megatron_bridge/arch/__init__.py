"""Per-architecture name/layout tables. Adding an architecture is one small file plus a line here."""

from collections.abc import Mapping
from typing import Any

from megatron_bridge.arch.base import Architecture
from megatron_bridge.arch.llama import LLAMA
from megatron_bridge.arch.qwen2 import QWEN2
from megatron_bridge.arch.qwen2_moe import QWEN2_MOE
from megatron_bridge.arch.qwen2_vl import QWEN2_5_VL, QWEN2_VL
from megatron_bridge.arch.qwen3 import QWEN3
from megatron_bridge.arch.qwen3_moe import QWEN3_MOE

_TABLES = (QWEN2, QWEN3, LLAMA, QWEN2_VL, QWEN2_5_VL, QWEN2_MOE, QWEN3_MOE)
ARCHITECTURES: dict[str, Architecture] = {name: arch for arch in _TABLES for name in arch.hf_architectures}
MODEL_TYPES: dict[str, Architecture] = {arch.model_type: arch for arch in _TABLES}


def get_architecture(hf_config: Mapping[str, Any]) -> Architecture:
    """The table for an HF config: by `architectures[0]`, else by `model_type`; `ValueError` if unknown."""
    names = hf_config.get("architectures") or []
    if names and names[0] in ARCHITECTURES:
        return ARCHITECTURES[names[0]]
    if not names and hf_config.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[hf_config["model_type"]]
    raise ValueError(
        f"config.json architectures={names!r} model_type={hf_config.get('model_type')!r} is not supported; "
        f"supported architectures: {sorted(ARCHITECTURES)}"
    )
