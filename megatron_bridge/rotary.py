"""RoPE on packed (`thd`) rows from per-token angles, for the layer specs built without Transformer Engine.

megatron-core rotates a packed row's queries and keys with `apply_rotary_pos_emb(..., cu_seqlens=...)`: a
table of angles for positions 0..longest-1, cut per sequence (and per context-parallel chunk) along the
bounds, which it reads back from the device (`cu_seqlens.tolist()`, a comparison with `cu_seqlens[-1]`, and for
M-RoPE an `.item()` per sequence) in every layer, twice. The model already knows each token's position: the
packed `position_ids` restart at 0 in each sequence, and under context parallelism they are this rank's tokens'
positions in their whole sequences (`megatron_bridge.context_parallel`). So here:

- `TokenRotaryGPTModel` (built by `token_rotary_gpt_model_class`) gathers megatron's angle table at those
  positions once per forward: a packed row's `rotary_pos_emb` is [t, 1, 1, dim], one row of angles per token.
  M-RoPE (`megatron_bridge.mrope.MRoPE`) already computes its angles per token from its 3 position rows;
- `TokenRotarySelfAttention` (the `torch` and `local` specs' self-attention) rotates a packed row's queries
  and keys with those per-token angles in one elementwise op, through megatron's own unpacked (`bshd`) rotation
  with `rotary_interleaved` and the YaRN scale as the config sets them. No `cu_seqlens` reaches RoPE, and no
  sequence is cut out: the numbers are the ones megatron's per-sequence path computes, without the host
  synchronisations.

Transformer Engine's spec keeps megatron's path (its fused `thd` RoPE kernel takes the bounds on the device).
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config as _yarn_scale,
)
from megatron.core.transformer.attention import SelfAttention


def is_packed(packed_seq_params) -> bool:
    return packed_seq_params is not None and packed_seq_params.qkv_format == "thd"


def per_token_angles(table: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """[t, 1, 1, dim] angles of the packed row's tokens: rows of megatron's `table` ([positions, 1, 1, dim],
    position p in row p) at `position_ids` ([1, t], each token's position in its sequence). A gather on the
    device: nothing is read back."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        shape = None if position_ids is None else tuple(position_ids.shape)
        raise ValueError(f"a packed row needs position_ids of shape [1, t] (each token's position in its "
                         f"sequence), got {shape}")
    index = position_ids.reshape(-1).to(device=table.device, dtype=torch.long)
    return table.index_select(0, index)


class TokenRotarySelfAttention(SelfAttention):
    """megatron's `SelfAttention`; on a packed row, `rotary_pos_emb` holds one row of angles per token
    ([t, 1, 1, dim], or a (query, key) pair of them) and rotates the queries and keys token by token, with no
    sequence bounds. Unpacked inputs, inference and layers without RoPE (`no_rope_freq`) are megatron's."""

    _token_angles: tuple[torch.Tensor, torch.Tensor] | None = None  # set for the duration of one packed forward

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        arguments = dict(key_value_states=key_value_states, inference_context=inference_context,
                         rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                         rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
                         packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
                         inference_params=inference_params)
        no_rope = bool(self.config.no_rope_freq) and bool(self.config.no_rope_freq[self.layer_number - 1])
        if (rotary_pos_emb is None or no_rope or not is_packed(packed_seq_params)
                or inference_context is not None or inference_params is not None):
            return super().forward(hidden_states, attention_mask, rotary_pos_emb=rotary_pos_emb, **arguments)
        angles = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb, rotary_pos_emb)
        self._token_angles = angles
        try:  # megatron's forward with RoPE applied as the queries and keys are made (see below), not after
            return super().forward(hidden_states, attention_mask, rotary_pos_emb=None, **arguments)
        finally:
            self._token_angles = None

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False,
                                    split_qkv=True):
        """megatron's queries and keys (after their q/k norms, where megatron rotates them), rotated by the
        per-token angles of the packed forward in progress."""
        out = super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate=output_gate,
                                                  split_qkv=split_qkv)
        if self._token_angles is None:
            return out
        if not split_qkv:
            raise ValueError("per-token RoPE needs the split queries and keys (fused_single_qkv_rope is off for "
                             "packed rows)")
        query, key, *rest = out  # [t, 1, heads, dim]: the packed row as one batch row
        return (self._rotate(query, self._token_angles[0]), self._rotate(key, self._token_angles[1]), *rest)

    def _rotate(self, x: torch.Tensor, angles: torch.Tensor | None) -> torch.Tensor:
        if angles is None:
            return x
        if angles.shape[0] != x.shape[0] or angles.dim() != 4:
            raise ValueError(f"a packed row of {x.shape[0]} tokens needs rotary angles per token "
                             f"[{x.shape[0]}, 1, 1, dim], got {tuple(angles.shape)} (build the model with "
                             "megatron_bridge.rotary.token_rotary_gpt_model_class, or M-RoPE)")
        return apply_rotary_pos_emb(x, angles, config=self.config, cu_seqlens=None, mscale=_yarn_scale(self.config),
                                    cp_group=self.pg_collection.cp)


def rotates_per_token(layer_spec) -> bool:
    """Whether a decoder layer spec's self-attention takes per-token angles on packed rows."""
    module = layer_spec.submodules.self_attention.module
    return isinstance(module, type) and issubclass(module, TokenRotarySelfAttention)


_CLASSES: dict[type, type] = {}


def token_rotary_gpt_model_class(base: type | None = None) -> type:
    """`base` (megatron's `GPTModel` by default) whose packed rows carry per-token RoPE angles; built on first
    use so that importing this module does not build it twice."""
    if base is None:
        from megatron.core.models.gpt import GPTModel

        base = GPTModel
    if base not in _CLASSES:
        class TokenRotaryGPTModel(base):
            """`base`, with a packed row's `rotary_pos_emb` gathered at `position_ids` ([t, 1, 1, dim]) for
            `TokenRotarySelfAttention`; unpacked rows and M-RoPE (already per token) as `base` computes them."""

            def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                            packed_seq_params=None, *args, **kwargs):
                out = super()._preprocess(input_ids, position_ids, decoder_input, inference_context,
                                          packed_seq_params, *args, **kwargs)
                if (self.position_embedding_type != "rope" or out[1] is None or not is_packed(packed_seq_params)
                        or inference_context is not None):
                    return out
                return (out[0], per_token_angles(out[1], position_ids), *out[2:])

        TokenRotaryGPTModel.__qualname__ = TokenRotaryGPTModel.__name__ = f"TokenRotary{base.__name__}"
        _CLASSES[base] = TokenRotaryGPTModel
    return _CLASSES[base]
