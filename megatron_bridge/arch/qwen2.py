"""Qwen2 / Qwen2.5: Llama-style layers with a bias on the q/k/v projections."""

from megatron_bridge.arch.base import LLAMA_STYLE_GLOBAL_ROWS, Architecture, llama_style_layer_rows

QWEN2 = Architecture(
    name="qwen2",
    model_type="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    qkv_bias=True,
    global_weights=LLAMA_STYLE_GLOBAL_ROWS,
    layer_weights=llama_style_layer_rows(qkv_bias=True),
)
