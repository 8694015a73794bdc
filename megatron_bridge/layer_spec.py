"""Which GPT layer the bridge builds (`model.attention`), and the one name translation between the layer specs.

- `torch`: megatron's local layer spec with our norms (`megatron_bridge.norm.RMSNorm`), our self-attention
  (`megatron_bridge.rotary.TokenRotarySelfAttention`: RoPE on packed rows from per-token angles, with no host
  synchronisation) and our core attention on torch's SDPA kernels (`megatron_bridge.attention.TorchCoreAttention`:
  packed sequences, context parallelism);
- `local`: the same with megatron's unfused core attention (no packed sequences, no context parallelism);
- `te`: megatron-core's `get_gpt_layer_with_transformer_engine_spec` (Transformer Engine's fused kernels; q/k
  RMSNorm for Qwen3), final norm `TENorm`. Needs `transformer_engine` and a CUDA GPU. Transformer Engine serves
  sequence parallelism, context parallelism (megatron's layout of 2 x cp chunks, the one
  `megatron_bridge.context_parallel` cuts; `TransformerConfig.cp_comm_type`, p2p by default) and packed THD rows
  (`PackedSeqParams`, int32 `cu_seqlens`) itself; RoPE and M-RoPE stay outside the core attention (megatron's
  `SelfAttention`), so vision-language models build on it as on the others;
- `auto` (default): `torch`, the spec that the CPU tests and the GPU device checks have run. Transformer Engine's
  spec is chosen by naming it (`te`) until a GPU run of `benchmarks/device_checks.sh` has checked it (logits and
  the round trip against transformers, the policy MFU benchmark); `TE_SPEC_CHECKED_ON_GPU` then lets `auto` pick
  it where it can run. `auto_reason` says which `auto` picked and why.

`resolve_attention` is the one place `auto` is decided.

The architecture tables (`megatron_bridge.arch`) are written in the local spec's parameter names. The TE spec
fuses each layer's two norms into the linear that follows them (`input_layernorm` and `pre_mlp_layernorm`
become `IdentityOp`); every other parameter keeps its name (q/k norms `q_layernorm.weight` /
`k_layernorm.weight`, the final norm `decoder.final_layernorm.weight`, the linears' `weight` / `bias`).
`TE_NAMES` is that difference; `to_te_name` / `to_local_name` apply it. Megatron's local spec states the same
pairs as its `sharded_state_dict_keys_map`, so distributed checkpoints already use the TE names for these norms
and load into either spec (see `megatron_bridge.checkpoint` for TE's `_extra_state` entries).
"""

from __future__ import annotations

from typing import Any

import torch

ATTENTION_CHOICES = ("auto", "te", "torch", "local")
# whether Transformer Engine's spec has passed the device checks (benchmarks/device_checks.sh, te parts) on a GPU:
# until it has, `auto` does not choose it (an untested path is never a default)
TE_SPEC_CHECKED_ON_GPU = False

# local-spec parameter name (inside a decoder layer) -> its name in megatron's TE spec. Pinned from megatron-core
# 0.16.1 `models/gpt/gpt_layer_specs.py` (`get_gpt_layer_with_transformer_engine_spec`: linear_qkv and
# linear_fc1 are `column_parallel_layer_norm_linear()`, input_layernorm / pre_mlp_layernorm IdentityOp) and
# Transformer Engine 2.11 `pytorch/module/layernorm_linear.py` (`LayerNormLinear` registers `layer_norm_weight`,
# and `layer_norm_bias` only for LayerNorm, not RMSNorm); tests/test_layer_spec.py checks both against the spec.
TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_LOCAL_NAMES = {te: local for local, te in TE_NAMES.items()}


def _translate(name: str, table: dict[str, str]) -> str:
    """`name` (megatron, "decoder.layers.<i>.<inside>") with its inside-the-layer part looked up in `table`."""
    if not name.startswith("decoder.layers."):
        return name
    decoder, layers, index, inside = name.split(".", 3)
    return ".".join((decoder, layers, index, table.get(inside, inside)))


def to_te_name(local_name: str) -> str:
    """The TE spec's name of a local-spec parameter name (unchanged where the specs agree)."""
    return _translate(local_name, TE_NAMES)


def to_local_name(name: str) -> str:
    """The local-spec (table) name of a parameter name of either spec."""
    return _translate(name, _LOCAL_NAMES)


def transformer_engine_missing() -> str | None:
    """Why Transformer Engine's layer spec cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import transformer_engine.pytorch  # noqa: F401
        from megatron.core.extensions import transformer_engine  # noqa: F401  (megatron's TE wrappers)
    except Exception as error:  # ImportError, or a TE build that does not match this torch / CUDA
        return f"transformer_engine does not import ({type(error).__name__}: {error})"
    return None


def resolve_attention(attention: str) -> str:
    """`model.attention` as it will run: `auto` becomes `te` or `torch`; `te` without Transformer Engine on a
    CUDA GPU is an error naming what is missing."""
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"model.attention={attention!r}: choose one of {', '.join(ATTENTION_CHOICES)}")
    if attention == "auto":
        return "te" if TE_SPEC_CHECKED_ON_GPU and transformer_engine_missing() is None else "torch"
    if attention == "te":
        missing = transformer_engine_missing()
        if missing is not None:
            raise RuntimeError(f"model.attention=te needs Transformer Engine on a CUDA GPU: {missing}; use "
                               "model.attention=torch (or auto, which picks te only where it can run)")
    return attention


def auto_reason() -> str:
    """Which spec `model.attention=auto` picks here, and why (printed when a run starts)."""
    missing = transformer_engine_missing()
    if missing is not None:
        return f"torch: Transformer Engine cannot run here ({missing})"
    if not TE_SPEC_CHECKED_ON_GPU:
        return ("torch: Transformer Engine is installed, but its spec has not yet passed the GPU device checks "
                "(benchmarks/device_checks.sh); model.attention=te uses it anyway")
    return "te: Transformer Engine runs here"


def layer_spec(attention: str, qk_layernorm: bool, num_experts: int = 0) -> tuple[Any, type]:
    """(decoder layer ModuleSpec, final norm class) for a resolved `attention` (te, torch or local); with
    `num_experts` a mixture-of-experts layer (a router and one `SequentialMLP` per expert, no grouped GEMM)."""
    moe = {"num_experts": num_experts or None, "moe_grouped_gemm": False}
    if attention == "te":
        from megatron.core.extensions.transformer_engine import TENorm
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm, **moe), TENorm
    if attention not in ("torch", "local"):
        raise ValueError(f"attention={attention!r}: resolve it first (resolve_attention); te, torch or local")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_bridge.norm import RMSNorm
    from megatron_bridge.rotary import TokenRotarySelfAttention

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm, **moe)
    layer = spec.submodules  # every norm ours (megatron's torch fallback refuses sequence parallelism)
    layer.input_layernorm = layer.pre_mlp_layernorm = RMSNorm
    layer.self_attention.module = TokenRotarySelfAttention  # packed rows: per-token RoPE angles (the model's)
    if qk_layernorm:
        layer.self_attention.submodules.q_layernorm = layer.self_attention.submodules.k_layernorm = RMSNorm
    if attention == "torch":
        from megatron_bridge.attention import TorchCoreAttention

        layer.self_attention.submodules.core_attention = TorchCoreAttention
    return spec, RMSNorm
