"""RMSNorm for the GPT layers we build, usable with sequence parallelism.

Without Apex or Transformer Engine megatron falls back to `torch.nn.RMSNorm` (`WrappedTorchNorm`) and refuses
sequence parallelism, because each tensor-parallel rank then normalises a different slice of the tokens and the
norm's weight gradient must be summed over the ranks. This is the same `torch.nn.RMSNorm` (same parameters,
same numbers), built from megatron's arguments, with its weight marked `sequence_parallel` so that megatron's
`finalize_model_grads` all-reduces that gradient over the tensor-parallel group.
"""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel
