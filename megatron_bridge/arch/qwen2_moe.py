"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2 attention (q/k/v bias) and routed SwiGLU experts
beside a shared expert whose output is scaled by sigmoid(shared_expert_gate(x))."""

from megatron_bridge.arch.base import EXPERT_ROWS, LLAMA_STYLE_GLOBAL_ROWS, Architecture, moe_layer_rows

QWEN2_MOE = Architecture(
    name="qwen2_moe",
    model_type="qwen2_moe",
    hf_architectures=("Qwen2MoeForCausalLM",),
    qkv_bias=True,
    global_weights=LLAMA_STYLE_GLOBAL_ROWS,
    layer_weights=moe_layer_rows(qkv_bias=True, shared_expert=True),
    expert_weights=EXPERT_ROWS,
)
