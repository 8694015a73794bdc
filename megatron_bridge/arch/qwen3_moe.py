"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (per-head q/k RMSNorm, no q/k/v bias) and a
routed mixture of SwiGLU experts in every layer, no shared expert."""

from megatron_bridge.arch.base import EXPERT_ROWS, LLAMA_STYLE_GLOBAL_ROWS, Architecture, moe_layer_rows

QWEN3_MOE = Architecture(
    name="qwen3_moe",
    model_type="qwen3_moe",
    hf_architectures=("Qwen3MoeForCausalLM",),
    qk_layernorm=True,
    global_weights=LLAMA_STYLE_GLOBAL_ROWS,
    layer_weights=moe_layer_rows(qk_norm=True),
    expert_weights=EXPERT_ROWS,
)
