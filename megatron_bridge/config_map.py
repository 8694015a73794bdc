"""Hugging Face `config.json` <-> megatron-core `TransformerConfig` and `GPTModel` arguments.

A field the bridge cannot honour is a `ValueError` that names it and its value; nothing is silently
defaulted. The way back (megatron -> HF) keeps the original HF config and checks that the megatron model
still describes it, so a saved checkpoint carries every HF field unchanged except its dtype.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from megatron_bridge.arch import Architecture
from megatron_bridge.vision import is_vision_language, language_config

SILU_NAMES = ("silu", "swish")  # transformers maps both to torch.nn.SiLU


def as_dict(hf: Mapping[str, Any] | Any) -> dict[str, Any]:
    """A config.json dict from a dict or a transformers `PretrainedConfig`."""
    return dict(hf) if isinstance(hf, Mapping) else hf.to_dict()


def check_supported(hf: Mapping[str, Any]) -> None:
    """Raise `ValueError` naming every HF config field whose behaviour the megatron model would not reproduce."""
    problems = []
    if hf.get("hidden_act", "silu") not in SILU_NAMES:
        problems.append(f"hidden_act={hf['hidden_act']!r} (only 'silu')")
    problems += _rope_problems(hf)
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field):
            problems.append(f"{field}={hf[field]!r} (no bias on attention output / MLP projections)")
    if hf.get("use_sliding_window"):
        problems.append(f"use_sliding_window={hf['use_sliding_window']!r} (no sliding-window attention)")
    other_layers = sorted(set(hf.get("layer_types") or ()) - {"full_attention"})
    if other_layers:
        problems.append(f"layer_types containing {other_layers} (only 'full_attention')")
    if float(hf.get("attention_dropout") or 0.0) != 0.0:
        problems.append(f"attention_dropout={hf['attention_dropout']!r} (only 0)")
    heads = hf.get("num_attention_heads", 1)
    groups = hf.get("num_key_value_heads") or heads
    if heads % groups:
        problems.append(f"num_key_value_heads={groups!r} does not divide num_attention_heads={heads!r}")
    problems += _moe_problems(hf)
    if problems:
        raise ValueError("config.json fields the bridge cannot honour: " + "; ".join(problems))


def num_experts(hf: Mapping[str, Any]) -> int:
    """Routed experts per layer, 0 for a dense model: `num_experts` (released Qwen-MoE configs) or
    `num_local_experts` (what transformers 5 writes for Qwen3-MoE)."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def _moe_problems(hf: Mapping[str, Any]) -> list[str]:
    """Every layer sparse (megatron's MoE layer spec for all of them), top-k routing it can reproduce."""
    experts = num_experts(hf)
    if not experts:
        return []
    problems = []
    if hf.get("decoder_sparse_step", 1) != 1:
        problems.append(f"decoder_sparse_step={hf['decoder_sparse_step']!r} (only 1: every layer a MoE layer)")
    if hf.get("mlp_only_layers"):
        problems.append(f"mlp_only_layers={hf['mlp_only_layers']!r} (only []: every layer a MoE layer)")
    topk = hf.get("num_experts_per_tok")
    if not isinstance(topk, int) or not 1 <= topk <= experts:
        problems.append(f"num_experts_per_tok={topk!r} (between 1 and the {experts} experts)")
    elif topk == 1 and hf.get("norm_topk_prob"):  # megatron's top-1 routing keeps the softmax probability
        problems.append("norm_topk_prob=True with num_experts_per_tok=1 (megatron's top-1 weight is the "
                        "softmax probability, not 1)")
    if not hf.get("moe_intermediate_size"):
        problems.append(f"moe_intermediate_size={hf.get('moe_intermediate_size')!r} (the experts' width is needed)")
    return problems


# megatron-core applies llama3 RoPE scaling with these fixed values; only `factor` is a parameter
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_scaling(hf: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(config field, its dict) of the RoPE scaling: `rope_scaling` (transformers 4) or
    `rope_parameters` (transformers 5), whichever names a type."""
    for field in ("rope_scaling", "rope_parameters"):
        rope = hf.get(field) or {}
        if "rope_type" in rope or "type" in rope:
            return field, dict(rope)
    return "rope_scaling", {}


def rope_type(hf: Mapping[str, Any]) -> str:
    rope = rope_scaling(hf)[1]
    return rope.get("rope_type", rope.get("type", "default"))


def _rope_problems(hf: Mapping[str, Any]) -> list[str]:
    field, rope = rope_scaling(hf)
    kind = rope_type(hf)
    if kind == "default" or (kind == "mrope" and rope.get("mrope_section")):  # Qwen-VL's 3-D split, see mrope.py
        return []
    if kind != "llama3":
        return [f"{field}={rope!r} (only unscaled RoPE or rope_type 'llama3')"]
    return [f"{field}.{key}={rope.get(key)!r} (megatron-core's llama3 scaling fixes it to {value})"
            for key, value in LLAMA3_FIXED.items() if float(rope.get(key, value)) != value]


def padded_vocab_size(vocab_size: int, tensor_parallel: int = 1, divisible_by: int = 128) -> int:
    """Rows of megatron's embedding and output layer: `vocab_size` rounded up to a multiple of
    lcm(divisible_by, tensor_parallel), so each tensor-parallel rank holds an equal slice and, for any
    TP that divides `divisible_by`, the padded size (and so a distributed checkpoint) does not depend on TP.
    The extra rows are zeros on the way in and dropped on the way out; their logits are not part of the
    model's output (see `Bridge.vocab_size`)."""
    multiple = math.lcm(divisible_by, tensor_parallel)
    return -(-vocab_size // multiple) * multiple


def rope_theta(hf: Mapping[str, Any]) -> float:
    """RoPE base, from `rope_theta` (transformers 4) or `rope_parameters.rope_theta` (transformers 5)."""
    if hf.get("rope_theta") is not None:
        return float(hf["rope_theta"])
    return float((hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def head_dim(hf: Mapping[str, Any]) -> int:
    """Per-head width: `head_dim` when given, else hidden_size / num_attention_heads."""
    return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])


def num_query_groups(hf: Mapping[str, Any]) -> int:
    """Key/value heads (GQA groups); equal to the attention heads when the config has none."""
    return int(hf.get("num_key_value_heads") or hf["num_attention_heads"])


def to_megatron(hf: Mapping[str, Any] | Any, arch: Architecture, params_dtype: torch.dtype = torch.float32,
                tensor_parallel: int = 1, pipeline_parallel: int = 1,
                vocab_divisible_by: int = 128, training: Mapping[str, Any] | None = None,
                context_parallel: int = 1, virtual_pipeline: int = 1,
                expert_parallel: int = 1) -> tuple[Any, dict[str, Any]]:
    """(TransformerConfig, GPTModel keyword arguments) describing the HF model at TP x PP (x `virtual_pipeline`
    chunks per pipeline rank, x EP for a mixture of experts), with CPU-safe settings: no fused kernels, no
    dropout, parameters created in `params_dtype`; `training` sets further TransformerConfig fields that do not
    change the model (activation recomputation, `moe_aux_loss_coeff`, ...)."""
    from megatron.core.transformer import TransformerConfig

    hf = as_dict(hf)
    check_supported(hf)
    _check_divisible(hf, tensor_parallel, pipeline_parallel, virtual_pipeline, expert_parallel)
    training = dict(training or {})
    moe = moe_fields(hf, expert_parallel, float(training.pop("moe_aux_loss_coeff", 0.0)))
    rope = rope_scaling(hf)[1]
    config = TransformerConfig(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        virtual_pipeline_model_parallel_size=virtual_pipeline if virtual_pipeline > 1 else None,
        context_parallel_size=context_parallel,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=num_query_groups(hf),
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
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        **moe,
        **training,
    )
    model_kwargs = dict(
        vocab_size=padded_vocab_size(hf["vocab_size"], tensor_parallel, vocab_divisible_by),
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        position_embedding_type="rope",
        rotary_base=rope_theta(hf),
        rope_scaling=rope_type(hf) == "llama3",
        rope_scaling_factor=float(rope.get("factor", 8.0)),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
    )
    return config, model_kwargs


def moe_fields(hf: Mapping[str, Any], expert_parallel: int = 1, aux_loss_coeff: float = 0.0) -> dict[str, Any]:
    """TransformerConfig fields of a mixture-of-experts model ({} for a dense one).

    Routing: HF takes the softmax over all experts, then the top k, renormalised over them when
    `norm_topk_prob`. Megatron's default (top k of the logits, softmax over those k) is that renormalised
    form; `moe_router_pre_softmax` (softmax over all, then top k, as is) is the other. Dropless (no capacity
    factor), experts one `SequentialMLP` each (no grouped GEMM), tokens exchanged by the all-to-all
    dispatcher (gloo on CPU runs it too). The load-balancing loss is off unless `aux_loss_coeff` > 0: RL
    fine-tunes an already balanced router, and HF's own `router_aux_loss_coef` only enters its loss with
    `output_router_logits`, so the bridge does not take it from config.json (`actor.moe_aux_loss_coef` sets it)."""
    experts = num_experts(hf)
    if not experts:
        if aux_loss_coeff:
            raise ValueError(f"moe_aux_loss_coeff={aux_loss_coeff} needs a mixture-of-experts model "
                             "(config.json has no num_experts)")
        return {}
    shared = int(hf.get("shared_expert_intermediate_size") or 0)
    return dict(
        num_moe_experts=experts,
        moe_router_topk=int(hf["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
        moe_shared_expert_intermediate_size=shared or None,
        moe_shared_expert_gate=bool(shared),  # Qwen2-MoE: sigmoid(shared_expert_gate(x)) x shared expert
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall",
        moe_expert_capacity_factor=None,
        moe_permute_fusion=False,
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=aux_loss_coeff,
        expert_model_parallel_size=expert_parallel,
    )


def _check_divisible(hf: Mapping[str, Any], tensor_parallel: int, pipeline_parallel: int,
                     virtual_pipeline: int = 1, expert_parallel: int = 1) -> None:
    layer_split = f"PP={pipeline_parallel}" + (f" x VPP={virtual_pipeline}" if virtual_pipeline > 1 else "")
    sizes = {"num_attention_heads": (hf["num_attention_heads"], tensor_parallel, f"TP={tensor_parallel}"),
             "num_key_value_heads": (num_query_groups(hf), tensor_parallel, f"TP={tensor_parallel}"),
             "num_hidden_layers": (hf["num_hidden_layers"], pipeline_parallel * virtual_pipeline, layer_split)}
    if num_experts(hf):  # every layer sparse: the dense `intermediate_size` is not built
        sizes["moe_intermediate_size"] = (hf["moe_intermediate_size"], tensor_parallel, f"TP={tensor_parallel}")
        sizes["shared_expert_intermediate_size"] = (hf.get("shared_expert_intermediate_size") or 0,
                                                    tensor_parallel, f"TP={tensor_parallel}")
        sizes["num_experts"] = (num_experts(hf), expert_parallel, f"EP={expert_parallel}")
    else:
        sizes["intermediate_size"] = (hf["intermediate_size"], tensor_parallel, f"TP={tensor_parallel}")
        if expert_parallel > 1:
            raise ValueError(f"expert parallelism EP={expert_parallel} needs a mixture-of-experts model "
                             f"(config.json has no num_experts)")
    bad = [f"{field}={value} is not divisible by {name}"
           for field, (value, size, name) in sizes.items() if value % size]
    if bad:
        raise ValueError("cannot shard this model: " + "; ".join(bad))


def to_hf_config(hf: Mapping[str, Any] | Any, model: Any, dtype: torch.dtype,
                 vocab_divisible_by: int = 128) -> dict[str, Any]:
    """The HF config dict to save beside `model`'s weights: the original `hf` with `dtype` set, after
    checking that the megatron `model` (a GPTModel chunk) still has the shape `hf` describes."""
    hf = as_dict(hf)
    lm = language_config(hf) if is_vision_language(hf) else hf
    config = model.config
    expected = {
        "num_hidden_layers": (config.num_layers, lm["num_hidden_layers"]),
        "hidden_size": (config.hidden_size, lm["hidden_size"]),
        "intermediate_size": (config.ffn_hidden_size, lm["intermediate_size"]),
        "num_attention_heads": (config.num_attention_heads, lm["num_attention_heads"]),
        "num_key_value_heads": (config.num_query_groups, num_query_groups(lm)),
        "head_dim": (config.kv_channels, head_dim(lm)),
        "rms_norm_eps": (config.layernorm_epsilon, float(lm.get("rms_norm_eps", 1e-6))),
        "vocab_size": (model.vocab_size, padded_vocab_size(lm["vocab_size"], config.tensor_model_parallel_size,
                                                           vocab_divisible_by)),
        "tie_word_embeddings": (model.share_embeddings_and_output_weights, bool(lm.get("tie_word_embeddings"))),
        "rope_theta": (float(model.rotary_base), rope_theta(lm)),
    }
    if num_experts(lm):
        expected.update({
            "num_experts": (config.num_moe_experts, num_experts(lm)),
            "num_experts_per_tok": (config.moe_router_topk, lm["num_experts_per_tok"]),
            "moe_intermediate_size": (config.moe_ffn_hidden_size, lm["moe_intermediate_size"]),
            "norm_topk_prob": (not config.moe_router_pre_softmax, bool(lm.get("norm_topk_prob", False))),
            "shared_expert_intermediate_size": (config.moe_shared_expert_intermediate_size or 0,
                                                int(lm.get("shared_expert_intermediate_size") or 0)),
        })
    else:
        expected["num_experts"] = (config.num_moe_experts, None)
    mismatched = [f"{name}: megatron {ours!r} vs config.json {theirs!r}"
                  for name, (ours, theirs) in expected.items() if ours != theirs]
    if mismatched:
        raise ValueError("megatron model does not match its HF config: " + "; ".join(mismatched))
    out = dict(hf)
    dtype_name = str(dtype).removeprefix("torch.")
    out["dtype"] = dtype_name
    if "torch_dtype" in out:  # transformers 4 spelling
        out["torch_dtype"] = dtype_name
    return out
