"""What an architecture file declares, and the q/k/v and gate/up layouts shared by all of them.

A table row is `(megatron name, HF name or names, layout)`; `{i}` stands for the layer index and, in a
mixture-of-experts table's `expert_weights`, `{e}` for the (global) expert index. Layouts:
- "same": one tensor, copied as is;
- "qkv": HF q/k/v projections fused into megatron's `linear_qkv`, interleaved per query group
  (each group's query heads, then its key head, then its value head);
- "gate_up": HF gate/up projections stacked into megatron's `linear_fc1` (gate rows first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Row = tuple[str, str | tuple[str, ...], str]
LAYOUTS = ("same", "qkv", "gate_up")


@dataclass(frozen=True)
class Architecture:
    name: str
    model_type: str  # HF `model_type`
    hf_architectures: tuple[str, ...]  # HF `architectures` entries this table describes
    global_weights: tuple[Row, ...]  # outside the decoder layers
    layer_weights: tuple[Row, ...]  # per decoder layer, with `{i}` for the layer index
    expert_weights: tuple[Row, ...] = ()  # per layer and routed expert (`{i}`, `{e}`): a mixture-of-experts model
    qkv_bias: bool = False
    qk_layernorm: bool = False
    vision: bool = False  # a vision tower on the first stage (its rows come from `megatron_bridge.vision`)
    ignored_hf_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry

    @property
    def moe(self) -> bool:
        return bool(self.expert_weights)

    def rows(self, num_layers: int, tied_embeddings: bool,
             num_experts: int = 0) -> list[tuple[str, tuple[str, ...], str]]:
        """Every (megatron name, HF names, layout) of a model with `num_layers` layers (and `num_experts`
        routed experts in each, for a mixture-of-experts table), in HF order.

        With tied embeddings the output layer is the embedding, so its row is left out."""
        out = []
        for mcore, hf, layout in self.global_weights:
            if tied_embeddings and mcore == "output_layer.weight":
                continue
            out.append((mcore, hf if isinstance(hf, tuple) else (hf,), layout))
        for i in range(num_layers):
            for mcore, hf, layout in self.layer_weights:
                names = hf if isinstance(hf, tuple) else (hf,)
                out.append((mcore.format(i=i), tuple(n.format(i=i) for n in names), layout))
            for e in range(num_experts if self.moe else 0):
                for mcore, hf, layout in self.expert_weights:
                    names = hf if isinstance(hf, tuple) else (hf,)
                    out.append((mcore.format(i=i, e=e), tuple(n.format(i=i, e=e) for n in names), layout))
        return out


def llama_style_attention_rows(qkv_bias: bool = False, qk_norm: bool = False) -> tuple[Row, ...]:
    """A Llama-style decoder layer's rows up to its MLP: the norms and GQA attention.

    Megatron names are those of `GPTModel` built with `get_gpt_layer_local_spec(normalization="RMSNorm")`:
    its layer norms are separate modules (`input_layernorm`, `pre_mlp_layernorm`), not the
    `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight` of Transformer Engine's fused spec, which
    `megatron_bridge.layer_spec.to_te_name` turns them into.
    """
    attn, layer = "model.layers.{i}.self_attn", "decoder.layers.{i}"
    rows: list[Row] = [
        (f"{layer}.input_layernorm.weight", "model.layers.{i}.input_layernorm.weight", "same"),
        (f"{layer}.self_attention.linear_qkv.weight",
         (f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"), "qkv"),
    ]
    if qkv_bias:
        rows.append((f"{layer}.self_attention.linear_qkv.bias",
                     (f"{attn}.q_proj.bias", f"{attn}.k_proj.bias", f"{attn}.v_proj.bias"), "qkv"))
    if qk_norm:  # RMSNorm over each head's channels, before RoPE
        rows += [(f"{layer}.self_attention.q_layernorm.weight", f"{attn}.q_norm.weight", "same"),
                 (f"{layer}.self_attention.k_layernorm.weight", f"{attn}.k_norm.weight", "same")]
    rows += [
        (f"{layer}.self_attention.linear_proj.weight", f"{attn}.o_proj.weight", "same"),
        (f"{layer}.pre_mlp_layernorm.weight", "model.layers.{i}.post_attention_layernorm.weight", "same"),
    ]
    return tuple(rows)


def swiglu_rows(megatron: str, hf: str) -> tuple[Row, ...]:
    """A SwiGLU MLP: HF `{hf}.gate_proj/up_proj/down_proj` <-> megatron `{megatron}.linear_fc1/linear_fc2`."""
    return ((f"{megatron}.linear_fc1.weight", (f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"), "gate_up"),
            (f"{megatron}.linear_fc2.weight", f"{hf}.down_proj.weight", "same"))


def llama_style_layer_rows(qkv_bias: bool = False, qk_norm: bool = False) -> tuple[Row, ...]:
    """The decoder-layer rows shared by Llama-style models (RMSNorm, GQA attention, SwiGLU MLP)."""
    return llama_style_attention_rows(qkv_bias, qk_norm) + swiglu_rows("decoder.layers.{i}.mlp", "model.layers.{i}.mlp")


def moe_layer_rows(qkv_bias: bool = False, qk_norm: bool = False, shared_expert: bool = False) -> tuple[Row, ...]:
    """A Qwen-MoE decoder layer without its routed experts (see `EXPERT_ROWS`): attention, the router
    (HF `mlp.gate`) and, with `shared_expert`, Qwen2-MoE's always-on expert and its sigmoid gate.

    Megatron names are those of `get_gpt_layer_local_spec(num_experts=..., moe_grouped_gemm=False)`:
    `TopKRouter`, `SequentialMLP` experts, `SharedExpertMLP` (its gate a [1, hidden] `gate_weight`)."""
    rows = llama_style_attention_rows(qkv_bias, qk_norm)
    rows += (("decoder.layers.{i}.mlp.router.weight", "model.layers.{i}.mlp.gate.weight", "same"),)
    if shared_expert:
        rows += swiglu_rows("decoder.layers.{i}.mlp.shared_experts", "model.layers.{i}.mlp.shared_expert")
        rows += (("decoder.layers.{i}.mlp.shared_experts.gate_weight", "model.layers.{i}.mlp.shared_expert_gate.weight",
                  "same"),)
    return rows


# one routed expert `{e}` of layer `{i}`, as released checkpoints store it (transformers 5 fuses the experts
# in memory, but saves and loads this per-expert form); megatron's `{e}` is global here, `sharding.ExpertShard`
# maps it to a rank's local index
EXPERT_ROWS: tuple[Row, ...] = swiglu_rows("decoder.layers.{i}.mlp.experts.local_experts.{e}",
                                           "model.layers.{i}.mlp.experts.{e}")


LLAMA_STYLE_GLOBAL_ROWS: tuple[Row, ...] = (
    ("embedding.word_embeddings.weight", "model.embed_tokens.weight", "same"),
    ("decoder.final_layernorm.weight", "model.norm.weight", "same"),
    ("output_layer.weight", "lm_head.weight", "same"),  # absent when embeddings are tied
)


def split_qkv(qkv: torch.Tensor, num_query_groups: int, heads_per_group: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron `linear_qkv` [groups * (heads/groups + 2) * d, ...] -> HF q [heads*d, ...], k/v [groups*d, ...]."""
    grouped = qkv.reshape(num_query_groups, (heads_per_group + 2) * head_dim, *qkv.shape[1:])
    q, k, v = torch.split(grouped, [heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, *qkv.shape[1:]), k.reshape(-1, *qkv.shape[1:]), v.reshape(-1, *qkv.shape[1:])


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF gate/up [ffn, hidden] each -> megatron `linear_fc1` [2*ffn, hidden]."""
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_gate_up`."""
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate, up
