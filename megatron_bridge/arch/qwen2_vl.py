"""Qwen2-VL / Qwen2.5-VL: a Qwen2 language model (q/k/v bias, M-RoPE) and a vision tower.

The language rows are Qwen2's: the checkpoints (official releases, and what transformers saves) keep the
language model under `model.*` / `lm_head.*`. The vision tower's rows (`visual.*`, replicated, "same"
layout) depend on its depth and are added by the bridge from the tower itself (see `megatron_bridge.vision`).
Qwen2-VL-2B and Qwen2.5-VL-3B tie their embeddings; the 7B and larger do not: both are handled as for Qwen2.
"""

from megatron_bridge.arch.base import LLAMA_STYLE_GLOBAL_ROWS, Architecture, llama_style_layer_rows


def _qwen_vl(model_type: str, hf_architecture: str) -> Architecture:
    return Architecture(name=model_type, model_type=model_type, hf_architectures=(hf_architecture,), qkv_bias=True,
                        vision=True, global_weights=LLAMA_STYLE_GLOBAL_ROWS,
                        layer_weights=llama_style_layer_rows(qkv_bias=True))


QWEN2_VL = _qwen_vl("qwen2_vl", "Qwen2VLForConditionalGeneration")
QWEN2_5_VL = _qwen_vl("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration")
