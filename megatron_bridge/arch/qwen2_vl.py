"""Qwen2-VL / Qwen2.5-VL: a Qwen2 language model (q/k/v bias, M-RoPE) and a vision tower.

The language rows are Qwen2's: the checkpoints (official releases, and what transformers saves) keep the
language model under `model.*` / `lm_head.*`. The vision tower's rows (`visual.*`, replicated, "same"
layout) depend on its depth and are added by the bridge from the tower itself (see `megatron_bridge.vision`).
Qwen2-VL-2B and Qwen2.5-VL-3B tie their embeddings; the 7B and larger do not: both are handled as for Qwen2.
"""

from megatron_bridge.arch.base import LLAMA_STYLE_GLOBAL_ROWS, Architecture, llama_style_layer_rows

QWEN2_VL = Architecture(
    name="qwen2_vl",
    model_type="qwen2_vl",
    hf_architectures=("Qwen2VLForConditionalGeneration",),
    qkv_bias=True,
    vision=True,
    global_weights=LLAMA_STYLE_GLOBAL_ROWS,
    layer_weights=llama_style_layer_rows(qkv_bias=True),
)

QWEN2_5_VL = Architecture(
    name="qwen2_5_vl",
    model_type="qwen2_5_vl",
    hf_architectures=("Qwen2_5_VLForConditionalGeneration",),
    qkv_bias=True,
    vision=True,
    global_weights=LLAMA_STYLE_GLOBAL_ROWS,
    layer_weights=llama_style_layer_rows(qkv_bias=True),
)
