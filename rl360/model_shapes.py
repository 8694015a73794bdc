"""The shapes of released models, by name, for planning without a local checkpoint (`rl360 plan`).

`released_config("Qwen/Qwen2.5-7B-Instruct")` is the `config.json` fields that count parameters and
activations of Qwen2.5-7B (as in its released config.json), or None for a name not listed. A name is matched
by its last path component, case-insensitively (Meta's "Meta-" prefix dropped), on a listed name followed by
nothing or by release suffixes that keep the shape ("-Instruct", "-Base", "-Thinking-2507", "-FP8", ...: `SUFFIXES`),
so "Qwen2.5-7B-Instruct", "qwen2.5-7b" and ".../Qwen2.5-7B" all match "Qwen2.5-7B", while "Qwen2.5-7Bx" and the
typo "Qwen2.5-7B-Instrct" match nothing (`close_names` gives what they may have meant). Listed: Qwen2.5 0.5B to
72B, Qwen3 0.6B to 32B and the MoE 30B-A3B and 235B-A22B, Qwen2.5-VL 3B, 7B, 32B and 72B, Llama 3 8B and 70B,
Llama 3.1 8B and 70B, Llama 3.2 1B and 3B, Llama 3.3 70B. Instruct and base checkpoints share their shape.
"""

from __future__ import annotations

import difflib
from typing import Any

_QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu",
          "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "max_position_embeddings": 32768}
_QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_act": "silu", "head_dim": 128,
          "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "vocab_size": 151936,
          "attention_bias": False}
_QWEN3_MOE = {**_QWEN3, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
              "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "tie_word_embeddings": False}
_LLAMA3 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "rms_norm_eps": 1e-05,
           "rope_theta": 500000.0, "max_position_embeddings": 8192, "attention_bias": False, "mlp_bias": False}
_LLAMA3_1 = {**_LLAMA3, "max_position_embeddings": 131072,
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}}
_LLAMA3_2 = {**_LLAMA3_1, "rope_scaling": {**_LLAMA3_1["rope_scaling"], "factor": 32.0}}
_VISION = {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
           "in_chans": 3, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
           "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2}
_QWEN2_5_VL = {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
               "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
               "max_position_embeddings": 128000, "image_token_id": 151655, "video_token_id": 151656,
               "vision_start_token_id": 151652, "vision_end_token_id": 151653,
               "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}


def _dense(base: dict, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
           tied: bool) -> dict[str, Any]:
    return {**base, "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
            "tie_word_embeddings": tied}


def _vl(*shape) -> dict[str, Any]:
    config = _dense(_QWEN2_5_VL, *shape)
    return {**config, "vision_config": {**_VISION, "out_hidden_size": config["hidden_size"]}}


# name -> config.json fields; hidden, intermediate, layers, attention heads, key/value heads, vocabulary, tied
RELEASED: dict[str, dict[str, Any]] = {
    "Qwen2.5-0.5B": _dense(_QWEN2, 896, 4864, 24, 14, 2, 151936, True),
    "Qwen2.5-1.5B": _dense(_QWEN2, 1536, 8960, 28, 12, 2, 151936, True),
    "Qwen2.5-3B": _dense(_QWEN2, 2048, 11008, 36, 16, 2, 151936, True),
    "Qwen2.5-7B": _dense(_QWEN2, 3584, 18944, 28, 28, 4, 152064, False),
    "Qwen2.5-14B": _dense(_QWEN2, 5120, 13824, 48, 40, 8, 152064, False),
    "Qwen2.5-32B": _dense(_QWEN2, 5120, 27648, 64, 40, 8, 152064, False),
    "Qwen2.5-72B": _dense(_QWEN2, 8192, 29568, 80, 64, 8, 152064, False),
    "Qwen3-0.6B": _dense(_QWEN3, 1024, 3072, 28, 16, 8, 151936, True),
    "Qwen3-1.7B": _dense(_QWEN3, 2048, 6144, 28, 16, 8, 151936, True),
    "Qwen3-4B": _dense(_QWEN3, 2560, 9728, 36, 32, 8, 151936, True),
    "Qwen3-8B": _dense(_QWEN3, 4096, 12288, 36, 32, 8, 151936, False),
    "Qwen3-14B": _dense(_QWEN3, 5120, 17408, 40, 40, 8, 151936, False),
    "Qwen3-32B": _dense(_QWEN3, 5120, 25600, 64, 64, 8, 151936, False),
    "Qwen3-30B-A3B": {**_QWEN3_MOE, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                      "num_experts": 128},
    "Qwen3-235B-A22B": {**_QWEN3_MOE, "hidden_size": 4096, "intermediate_size": 12288,
                        "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64,
                        "num_key_value_heads": 4, "num_experts": 128},
    "Qwen2.5-VL-3B": _vl(2048, 11008, 36, 16, 2, 151936, True),
    "Qwen2.5-VL-7B": _vl(3584, 18944, 28, 28, 4, 152064, False),
    "Qwen2.5-VL-32B": _vl(5120, 27648, 64, 40, 8, 152064, False),
    "Qwen2.5-VL-72B": _vl(8192, 29568, 80, 64, 8, 152064, False),
    "Llama-3-8B": _dense(_LLAMA3, 4096, 14336, 32, 32, 8, 128256, False),
    "Llama-3-70B": _dense(_LLAMA3, 8192, 28672, 80, 64, 8, 128256, False),
    "Llama-3.1-8B": _dense(_LLAMA3_1, 4096, 14336, 32, 32, 8, 128256, False),
    "Llama-3.1-70B": _dense(_LLAMA3_1, 8192, 28672, 80, 64, 8, 128256, False),
    "Llama-3.2-1B": {**_dense(_LLAMA3_2, 2048, 8192, 16, 32, 8, 128256, True), "head_dim": 64},
    "Llama-3.2-3B": {**_dense(_LLAMA3_2, 3072, 8192, 28, 24, 8, 128256, True), "head_dim": 128},
    "Llama-3.3-70B": _dense(_LLAMA3_1, 8192, 28672, 80, 64, 8, 128256, False),
}


# release suffixes that keep a model's shape (instruct, base, thinking and dated variants, quantised copies)
SUFFIXES = frozenset({"instruct", "base", "chat", "it", "thinking", "2507", "fp8", "awq", "gptq", "int4", "int8",
                      "bf16", "hf"})


def _last_name(path: str) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1].lower().removeprefix("meta-")


def released_name(path: str) -> str | None:
    """The listed name `path` (a hub id, a name or a directory named after the model) stands for, or None."""
    last = _last_name(path)
    for name in sorted(RELEASED, key=len, reverse=True):
        key = name.lower()
        if last == key or (last.startswith(key + "-")
                           and all(part in SUFFIXES for part in last[len(key) + 1:].split("-"))):
            return name
    return None


def close_names(path: str, count: int = 3) -> list[str]:
    """Listed names (bare and "-Instruct") closest to the name `path` gives, for a did-you-mean."""
    spelled = {variant.lower(): variant for name in RELEASED for variant in (name, f"{name}-Instruct")}
    return [spelled[match] for match in difflib.get_close_matches(_last_name(path), spelled, n=count, cutoff=0.75)]


def released_config(path: str) -> dict[str, Any] | None:
    """A copy of the listed config.json fields for the model `path` names (see the module doc), or None."""
    name = released_name(path)
    return None if name is None else {**RELEASED[name]}
