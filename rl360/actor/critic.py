"""One rank of the PPO critic: the policy's Megatron model with a value head instead of the vocabulary.

It is a `PolicyWorker` in every other respect (parallel state, megatron DDP, optimizer, forward-backward
schedule, mini-batches and epochs), so the same TP x PP x DP layouts run; only the head, the loss and the
optimizer settings (`critic.*`) differ. The value of response token j is read where its log-prob is: at
the position that predicts it (the state before the action).
"""

from __future__ import annotations

import torch
from torch import nn

from rl360.actor.batch import RolloutBatch
from rl360.actor.policy import PolicyWorker
from rl360.algos.losses import agg_loss, value_loss


class ValueHead(nn.Linear):
    """hidden -> 1, in place of GPTModel's output layer (same call signature: returns `(output, bias)`; its
    parameters are `output_layer.weight` / `.bias`, the names megatron's sharded state dict expects).
    Replicated on every tensor-parallel rank; starts at zero. With sequence parallelism the hidden states arrive
    split along the sequence: they are gathered first, and in the backward pass each rank keeps its part of the
    (identical, whole) gradient, since every rank computes the same values from the same states."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device, sequence_parallel: bool = False):
        super().__init__(hidden_size, 1, dtype=dtype, device=device)
        self.sequence_parallel = sequence_parallel
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None, **_) -> tuple:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return super().forward(hidden), None


class CriticWorker(PolicyWorker):
    metric_prefix = "critic"

    def _optimizer_settings(self):
        return self.settings.critic

    @property
    def micro_batch_size(self) -> int:
        """`critic.micro_batch_size`, else the actor's (a value head needs no vocabulary logits, so the
        critic often fits larger micro-batches)."""
        return self.settings.critic.micro_batch_size or self.settings.actor.micro_batch_size

    def _needs_reference(self) -> bool:
        return False

    def _lora_spec(self) -> None:
        return None  # actor.lora adapts the policy; the critic trains whole

    def _build_model(self, dtype: torch.dtype, adapters: bool = False) -> list:
        chunks = super()._build_model(dtype)  # HF weights loaded first, through the bridge's table
        for chunk in chunks:
            if chunk.post_process:
                chunk.output_layer = ValueHead(chunk.config.hidden_size, dtype, next(chunk.parameters()).device,
                                               chunk.config.sequence_parallel)
            chunk.share_embeddings_and_output_weights = False  # the head is not the embedding
        return chunks

    def _head_output(self, output: torch.Tensor) -> torch.Tensor:
        return output[..., 0].float()  # [B, T] values

    def _per_token(self, values: torch.Tensor, labels: torch.Tensor, with_entropy: bool) -> torch.Tensor:
        return values  # a value per position already: gathered as they are

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor | None:
        """[B, R] values of the response positions (zero past each response); None off the last stage."""
        micro = self._micro_batches(batch)

        def collect(values: torch.Tensor, mb: RolloutBatch, non_loss_data: bool = True):
            return (values[self._response_index(values, mb)] * mb.response_mask).detach()

        with torch.no_grad():
            outputs = self._schedule(self.models, micro, collect, forward_only=True)
        return self._in_batch_order(outputs).cpu() if self.last_stage else None

    def _loss(self, values: torch.Tensor, mb: RolloutBatch, normalizer: float, num_micro: int):
        """Clipped value loss of one micro-batch, scaled like the policy's (see `PolicyWorker._loss`)."""
        mask = mb.response_mask
        predicted = values[self._response_index(values, mb)]
        per_token, clipped = value_loss(predicted, mb.values, mb.returns, self.settings.critic.cliprange_value)
        loss = agg_loss(per_token, mask, self.settings.actor.loss_agg_mode, normalizer,
                        self.settings.max_response_length)
        share = self._tokens_in_mini
        report = {"critic/vf_loss": loss.detach(),  # 0-dim device tensors, read once a mini-batch
                  "critic/vf_clipfrac": (clipped * mask).sum() / share,
                  "critic/vpred_mean": (predicted.detach() * mask).sum() / share}
        return self._undo_megatron_scaling(loss, num_micro), report
