"""The policy's update: PPO epochs over mini-batches, each micro-batch's loss (the policy loss with rollout
correction, the KL to the reference, the entropy bonus) through megatron's schedule, and the optimizer step.

`PolicyUpdate` is a part of `rl360.actor.policy.PolicyWorker` (the critic and SFT workers replace `_loss`); it reads
the worker's `settings`, `models`, `optimizer`, `offload`, `dp_size`, `dp_group`, `context`, `device`, `metric_prefix`,
and its forward parts `_micro_batches`, `_schedule`, `_logprobs_and_entropy` and `_resident`.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch

from rl360.actor.batch import RolloutBatch
from rl360.algos.losses import agg_loss, agg_normalizer, get_policy_loss, kl_penalty, rollout_correction


class PolicyUpdate:
    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """PPO epochs over mini-batches of `batch`; returns averaged metrics."""
        cfg = self.settings.actor
        mini_size = cfg.ppo_mini_batch_size * self.settings.group_size // self.dp_size  # this rank's share
        generator = torch.Generator().manual_seed(self.settings.seed)
        totals: dict[str, float] = {}
        steps = 0
        with self._resident("weights", "grads"):  # the optimizer state comes for each step (`_optimizer_step`)
            for chunk in self.models:
                chunk.train()
            for _ in range(cfg.ppo_epochs):
                order = torch.randperm(len(batch), generator=generator)
                for start in range(0, len(batch), mini_size):
                    mini = batch.select(order[start:start + mini_size])
                    for name, value in self._optimizer_step(mini).items():
                        totals[name] = totals.get(name, 0.0) + value
                    steps += 1
        return {name: value / steps for name, value in totals.items()}

    def _optimizer_step(self, mini: RolloutBatch) -> dict[str, float]:
        reports = self.accumulate_gradients(mini)
        with self.offload.only_during("optimizer") if self.offload is not None else contextlib.nullcontext():
            ok, grad_norm, _ = self.optimizer.step()
        metrics = {key: sum(r[key] for r in reports) for key in reports[0]} if reports else {}
        metrics[f"{self.metric_prefix}/grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics[f"{self.metric_prefix}/update_skipped"] = 0.0 if ok else 1.0
        return metrics

    def accumulate_gradients(self, mini: RolloutBatch) -> list[dict[str, float]]:
        """Zero the gradients, then forward/backward every micro-batch of `mini`; per-micro-batch reports (read
        from the device once, after the last micro-batch).

        Gradients end in megatron's `main_grad` buffers, equal to those of the unsplit mini-batch."""
        # denominators of the whole mini-batch, over every data-parallel rank's share of it (summed on the host
        # at one rank: the step does not wait for the device)
        mode = self.settings.actor.loss_agg_mode
        counts = [agg_normalizer(mini.response_mask, mode), float(mini.response_mask.sum())]
        if self.dp_size > 1:
            reduced = torch.tensor(counts, dtype=torch.float64, device=self.device)
            torch.distributed.all_reduce(reduced, group=self.dp_group)
            counts = reduced.tolist()
        normalizer = max(counts[0], 1.0)
        self._tokens_in_mini = max(counts[1], 1.0)
        micro = self._micro_batches(mini)
        with self._resident("weights", "grads"):
            for chunk in self.models:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            loss_fn = partial(self._loss, normalizer=normalizer, num_micro=len(micro))
            return reports_to_floats(self._schedule(self.models, micro, loss_fn, forward_only=False))

    def _loss(self, logits: torch.Tensor, mb: RolloutBatch, normalizer: float, num_micro: int):
        """Loss of one micro-batch, scaled so megatron's division by the micro-batch count cancels and
        the summed gradient is that of the whole mini-batch under the configured aggregation."""
        cfg, algo = self.settings.actor, self.settings.algorithm
        mask = mb.response_mask
        logprob, entropy = self._logprobs_and_entropy(logits, mb)

        def aggregate(per_token: torch.Tensor) -> torch.Tensor:
            return agg_loss(per_token, mask, cfg.loss_agg_mode, normalizer, self.settings.max_response_length)

        def token_mean(per_token: torch.Tensor) -> torch.Tensor:
            """This micro-batch's part of the mini-batch's token mean (parts add up over micro-batches)."""
            return (per_token.detach() * mask).sum() / self._tokens_in_mini

        pg_tokens, clipped = get_policy_loss(cfg.loss_mode)(logprob, mb.old_logprobs, mb.advantages, mask, cfg)
        is_weights = rollout_correction(mb.old_logprobs, mb.rollout_logprobs, cfg.rollout_correction,
                                        cfg.rollout_is_threshold, cfg.rollout_is_threshold_lower, mask,
                                        cfg.rollout_is_level, cfg.rollout_is_veto_threshold)
        pg_loss = aggregate(pg_tokens * is_weights)
        loss = pg_loss
        report = {"actor/pg_loss": pg_loss.detach()}  # 0-dim device tensors: `reports_to_floats` reads them
        if algo.kl_coef > 0:
            kl = aggregate(kl_penalty(logprob, mb.ref_logprobs, algo.kl_estimator))
            loss = loss + algo.kl_coef * kl
            report["actor/kl"] = kl.detach()
        if cfg.entropy_coeff:
            loss = loss - cfg.entropy_coeff * aggregate(entropy)
        report["actor/entropy"] = token_mean(entropy)
        report["actor/pg_clipfrac"] = token_mean(clipped)
        report["actor/ppo_kl"] = token_mean(mb.old_logprobs - logprob)
        if cfg.rollout_correction != "none":
            report["rollout_correction/mean_weight"] = token_mean(is_weights)
            report["rollout_correction/zero_weight_frac"] = token_mean((is_weights == 0).float())
        return self._undo_megatron_scaling(loss, num_micro), report

    def _undo_megatron_scaling(self, loss: torch.Tensor, num_micro: int) -> torch.Tensor:
        """Megatron divides each micro-batch's loss by the micro-batch count, multiplies it by the context-parallel
        size and averages gradients over the data- and context-parallel ranks. The loss here is already normalised
        by the mini-batch's global counts and (gathered) the same on every context-parallel rank: undo all three."""
        return loss * num_micro * self.dp_size / self.context


def reports_to_floats(reports: list[dict]) -> list[dict[str, float]]:
    """Per-micro-batch reports whose values are 0-dim tensors (or floats) as floats: the tensors are read from the
    device in one transfer."""
    tensors = [value for report in reports for value in report.values() if torch.is_tensor(value)]
    read = iter(torch.stack([value.detach().reshape(()).to(tensors[0].device, torch.float64)
                             for value in tensors]).tolist() if tensors else [])
    return [{key: next(read) if torch.is_tensor(value) else float(value) for key, value in report.items()}
            for report in reports]
