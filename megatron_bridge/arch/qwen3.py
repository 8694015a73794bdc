"""Qwen3 (dense): Llama-style layers without q/k/v bias, with an RMSNorm on each query and key head."""

from megatron_bridge.arch.base import LLAMA_STYLE_GLOBAL_ROWS, Architecture, llama_style_layer_rows

QWEN3 = Architecture(
    name="qwen3",
    model_type="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    qk_layernorm=True,
    global_weights=LLAMA_STYLE_GLOBAL_ROWS,
    layer_weights=llama_style_layer_rows(qk_norm=True),
)
