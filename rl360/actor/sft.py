"""One rank of supervised fine-tuning: the policy's Megatron model trained on the negative log-likelihood of the
conversations' assistant tokens.

It is a `PolicyWorker` in every other respect (parallel state, megatron DDP, optimizer, forward-backward schedule,
micro-batches by count or token budget, packing, LoRA, offload, checkpoints, HF export), so the same layouts run.
A conversation is a `RolloutBatch` row: its tokens before the first assistant message are the prompt, the rest the
response, and `response_mask` is 1 on the assistant tokens only (rl360/data/conversations.py): every other token
is context, as a tool reply is in a trajectory. Log-probs are of the model's own distribution (temperature 1).
"""

from __future__ import annotations

import torch

from rl360.actor.batch import RolloutBatch
from rl360.actor.policy import PolicyWorker
from rl360.algos.losses import agg_loss


class SFTWorker(PolicyWorker):
    metric_prefix = "sft"

    @property
    def temperature(self) -> float:
        return 1.0

    def _needs_reference(self) -> bool:
        return False

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """One optimizer step on this rank's share of the batch (the loss normalised over every rank's share)."""
        with self._resident("weights", "grads"):
            for chunk in self.models:
                chunk.train()
            return self._optimizer_step(batch)

    def _loss(self, logits: torch.Tensor, mb: RolloutBatch, normalizer: float, num_micro: int):
        """The negative log-likelihood of the micro-batch's assistant tokens under `actor.loss_agg_mode` (token-mean:
        per token of the whole step), scaled as the policy's loss is (`PolicyWorker._loss`)."""
        mask = mb.response_mask
        logprob, _ = self._logprobs_and_entropy(logits, mb, with_entropy=False)
        loss = agg_loss(-logprob, mask, self.settings.actor.loss_agg_mode, normalizer, self.settings.sft_max_length)
        report = {"sft/loss": loss.detach(), "sft/token_nll": (-logprob.detach() * mask).sum() / self._tokens_in_mini}
        return self._undo_megatron_scaling(loss, num_micro), report
