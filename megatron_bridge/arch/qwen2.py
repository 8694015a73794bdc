"""Qwen2 / Qwen2.5 (QKV bias, SwiGLU, RMSNorm, RoPE): Hugging Face names <-> megatron-core names.

Megatron names are those of `GPTModel` built with `get_gpt_layer_local_spec(normalization="RMSNorm")`:
its layer norms are separate modules (`input_layernorm`, `pre_mlp_layernorm`), not the
`linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight` that Transformer Engine's fused spec has.
"""

from megatron_bridge.arch.base import Architecture

_ATTN = "model.layers.{i}.self_attn"
_MLP = "model.layers.{i}.mlp"

QWEN2 = Architecture(
    name="qwen2",
    model_type="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    qkv_bias=True,
    global_weights=(
        ("embedding.word_embeddings.weight", "model.embed_tokens.weight", "same"),
        ("decoder.final_layernorm.weight", "model.norm.weight", "same"),
        ("output_layer.weight", "lm_head.weight", "same"),  # absent when embeddings are tied
    ),
    layer_weights=(
        ("decoder.layers.{i}.input_layernorm.weight", "model.layers.{i}.input_layernorm.weight", "same"),
        ("decoder.layers.{i}.self_attention.linear_qkv.weight",
         (f"{_ATTN}.q_proj.weight", f"{_ATTN}.k_proj.weight", f"{_ATTN}.v_proj.weight"), "qkv"),
        ("decoder.layers.{i}.self_attention.linear_qkv.bias",
         (f"{_ATTN}.q_proj.bias", f"{_ATTN}.k_proj.bias", f"{_ATTN}.v_proj.bias"), "qkv"),
        ("decoder.layers.{i}.self_attention.linear_proj.weight", f"{_ATTN}.o_proj.weight", "same"),
        ("decoder.layers.{i}.pre_mlp_layernorm.weight", "model.layers.{i}.post_attention_layernorm.weight", "same"),
        ("decoder.layers.{i}.mlp.linear_fc1.weight", (f"{_MLP}.gate_proj.weight", f"{_MLP}.up_proj.weight"),
         "gate_up"),
        ("decoder.layers.{i}.mlp.linear_fc2.weight", f"{_MLP}.down_proj.weight", "same"),
    ),
)
