"""The vision side of Qwen2-VL / Qwen2.5-VL checkpoints: their language-model config and their vision tower.

A vision-language config.json comes in two spellings: transformers 4 (and the official Qwen releases) put the
language model's fields at the top level beside `vision_config`; transformers 5 nests them in `text_config`.
`language_config` gives the flat language-model fields either way, so the rest of the bridge reads one shape.

The vision tower is transformers' own module (`Qwen2VisionTransformerPretrainedModel`,
`Qwen2_5_VisionTransformerPretrainedModel`), replicated on every tensor-parallel rank of the first pipeline
stage: megatron-core has no tensor-parallel version of these towers (window attention, 2-D rotary patches,
the patch merger), and at ~0.7B parameters against a 7B-32B language model a replica costs little. Its
parameter names are the checkpoint's `visual.*` names with the prefix dropped, so its table rows map one to
one ("same" layout) and its weights reach the engines under the names transformers loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# the checkpoint prefix of the vision tower's tensors, and the attribute that holds it in the megatron model
HF_PREFIX = "visual."
MEGATRON_PREFIX = "vision."


def is_vision_language(hf: Mapping[str, Any]) -> bool:
    return "vision_config" in hf


def language_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's flat config fields: `text_config` merged over the top level (transformers 5),
    or the top level itself (transformers 4 / official Qwen releases); the top level's
    `tie_word_embeddings` wins, since it is the field transformers reads for the whole model."""
    flat = {key: value for key, value in hf.items() if key not in ("text_config", "vision_config")}
    flat.update(hf.get("text_config") or {})
    if "tie_word_embeddings" in hf:
        flat["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return flat


def mrope_section(hf: Mapping[str, Any]) -> list[int]:
    """How many rotary frequency pairs follow the temporal, height and width positions (they sum to
    head_dim / 2), from `rope_parameters` (transformers 5) or `rope_scaling` (transformers 4)."""
    lm = language_config(hf)
    for field in ("rope_parameters", "rope_scaling"):
        section = (lm.get(field) or {}).get("mrope_section")
        if section:
            return [int(part) for part in section]
    raise ValueError("config.json has no mrope_section (in rope_parameters or rope_scaling): a Qwen-VL language "
                     "model needs its 3-D rotary split")


def image_token_id(hf: Mapping[str, Any]) -> int:
    token = hf.get("image_token_id", (hf.get("text_config") or {}).get("image_token_id"))
    if token is None:
        raise ValueError("config.json has no image_token_id")
    return int(token)


def build_vision_tower(hf: Mapping[str, Any], dtype: torch.dtype) -> torch.nn.Module:
    """A randomly initialised vision tower (merger included) of the checkpoint's family, in `dtype`, with
    SDPA attention; the bridge loads its weights."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(**dict(hf)).vision_config
    config._attn_implementation = "sdpa"
    tower_class = _tower_class(hf["model_type"])
    return tower_class._from_config(config).to(dtype)


def vision_parameter_names(hf: Mapping[str, Any]) -> list[str]:
    """The vision tower's parameter names (without prefix) in its module order, from a meta-device build."""
    return list(_meta_tower_parameters(hf))


def vision_parameter_count(hf: Mapping[str, Any]) -> int:
    return sum(param.numel() for param in _meta_tower_parameters(hf).values())


def _meta_tower_parameters(hf: Mapping[str, Any]) -> dict[str, torch.nn.Parameter]:
    with torch.device("meta"):
        return dict(build_vision_tower(hf, torch.float32).named_parameters())


def _tower_class(model_type: str):
    if model_type == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        return Qwen2VisionTransformerPretrainedModel
    if model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        return Qwen2_5_VisionTransformerPretrainedModel
    raise ValueError(f"model_type={model_type!r} has no vision tower here (qwen2_vl, qwen2_5_vl)")

