"""Qwen2 / Qwen2.5 (QKV bias, SwiGLU, RMSNorm, RoPE): Hugging Face names <-> megatron-core names.

Each row: (megatron name, Hugging Face name(s), layout). `{i}` is the layer index. Layouts:
- "same": one tensor, copied as is;
- "qkv": HF q/k/v projections fused into megatron's `linear_qkv`, interleaved per query group;
- "gate_up": HF gate/up projections stacked into megatron's `linear_fc1` (gate first).
"""

from megatron_bridge.arch.base import Architecture

QWEN2 = Architecture(
    name="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    qkv_bias=True,
    global_weights=[
        ("embedding.word_embeddings.weight", "model.embed_tokens.weight", "same"),
        ("decoder.final_layernorm.weight", "model.norm.weight", "same"),
        ("output_layer.weight", "lm_head.weight", "same"),  # absent when embeddings are tied
    ],
    layer_weights=[
        ("decoder.layers.{i}.input_layernorm.weight", "model.layers.{i}.input_layernorm.weight", "same"),
        ("decoder.layers.{i}.self_attention.linear_qkv.weight",
         ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
          "model.layers.{i}.self_attn.v_proj.weight"), "qkv"),
        ("decoder.layers.{i}.self_attention.linear_qkv.bias",
         ("model.layers.{i}.self_attn.q_proj.bias", "model.layers.{i}.self_attn.k_proj.bias",
          "model.layers.{i}.self_attn.v_proj.bias"), "qkv"),
        ("decoder.layers.{i}.self_attention.linear_proj.weight", "model.layers.{i}.self_attn.o_proj.weight", "same"),
        ("decoder.layers.{i}.pre_mlp_layernorm.weight", "model.layers.{i}.post_attention_layernorm.weight",
         "same"),
        ("decoder.layers.{i}.mlp.linear_fc1.weight",
         ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"), "gate_up"),
        ("decoder.layers.{i}.mlp.linear_fc2.weight", "model.layers.{i}.mlp.down_proj.weight", "same"),
    ],
)
