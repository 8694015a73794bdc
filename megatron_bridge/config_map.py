"""Hugging Face `config.json` -> megatron-core `TransformerConfig` and `GPTModel` arguments.

A field the bridge cannot honour is a `ValueError` that names it; nothing is silently defaulted.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_bridge.arch import Architecture


def check_supported(hf: dict[str, Any]) -> None:
    """Raise for HF config fields whose behaviour the megatron model would not reproduce."""
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (only 'silu')")
    scaling = hf.get("rope_scaling") or {}
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        problems.append(f"rope_scaling={hf['rope_scaling']!r} (only unscaled RoPE)")
    if hf.get("use_sliding_window"):
        problems.append("use_sliding_window=True (sliding-window attention)")
    if float(hf.get("attention_dropout", 0.0) or 0.0) != 0.0:
        problems.append(f"attention_dropout={hf['attention_dropout']} (only 0)")
    if hf.get("num_attention_heads", 1) % hf.get("num_key_value_heads", hf.get("num_attention_heads", 1)):
        problems.append("num_attention_heads is not a multiple of num_key_value_heads")
    if problems:
        raise ValueError("config.json fields the bridge cannot honour: " + "; ".join(problems))


def rope_theta(hf: dict[str, Any]) -> float:
    if "rope_theta" in hf:
        return float(hf["rope_theta"])
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def head_dim(hf: dict[str, Any]) -> int:
    return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])


def to_megatron(hf: dict[str, Any], arch: Architecture, params_dtype: torch.dtype = torch.float32):
    """(TransformerConfig, GPTModel keyword arguments) for an HF config dict."""
    from megatron.core.transformer import TransformerConfig

    check_supported(hf)
    config = TransformerConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        kv_channels=head_dim(hf),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    model_kwargs = dict(
        vocab_size=hf["vocab_size"],
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        position_embedding_type="rope",
        rotary_base=rope_theta(hf),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
    )
    return config, model_kwargs
