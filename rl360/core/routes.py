"""SGLang's wire form of the experts a mixture-of-experts model routed each token to (`meta_info.routed_experts`,
asked for with `return_routed_experts: true`): the base64 of an int32 array `[tokens, num_hidden_layers, top_k]`,
one entry per token that went through the model (prompt + response - 1)."""

from __future__ import annotations

import base64

import numpy as np
import torch


def encode_routes(routes: torch.Tensor) -> str:
    """SGLang's wire form: the base64 of the int32 array."""
    return base64.b64encode(routes.to(torch.int32).numpy().tobytes()).decode("ascii")


def decode_routes(text: str, tokens: int) -> torch.Tensor:
    """`[tokens, num_layers * top_k]` int16 routes from SGLang's `meta_info.routed_experts` of a sequence whose
    model ran `tokens` tokens (prompt + response - 1); ValueError when the ids do not split evenly."""
    values = np.frombuffer(base64.b64decode(text), dtype=np.int32)
    if tokens <= 0 or values.size % tokens:
        raise ValueError(f"routed_experts holds {values.size} expert ids, not a whole number per token for "
                         f"{tokens} tokens")
    return torch.from_numpy(values.astype(np.int16)).view(tokens, -1)
