"""Llama 3.x (and Llama 2): no biases, GQA, optional `llama3` RoPE scaling (see config_map)."""

from megatron_bridge.arch.base import LLAMA_STYLE_GLOBAL_ROWS, Architecture, llama_style_layer_rows

LLAMA = Architecture(
    name="llama",
    model_type="llama",
    hf_architectures=("LlamaForCausalLM",),
    global_weights=LLAMA_STYLE_GLOBAL_ROWS,
    layer_weights=llama_style_layer_rows(),
)
