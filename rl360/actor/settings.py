"""What the policy and critic ranks read of a run's config: `PolicySettings.of(cfg)`, made once in the driver and
sent to every rank (a frozen dataclass of the config's own dataclasses: it pickles through Ray as they do)."""

from __future__ import annotations

from dataclasses import dataclass

from rl360.config import ActorConfig, AlgorithmConfig, CriticConfig, ModelConfig, RunConfig


@dataclass(frozen=True)
class PolicySettings:
    """The actor, model, algorithm and critic sections whole, and the few other settings a rank reads."""

    actor: ActorConfig
    model: ModelConfig
    algorithm: AlgorithmConfig  # the KL terms (a reference model when one is needed)
    critic: CriticConfig  # the critic's optimizer, micro-batches and value clipping
    seed: int  # parallel-state RNGs, LoRA's initialisation, the mini-batches' shuffle
    group_size: int  # rollout.n: responses per prompt (a mini-batch is actor.ppo_mini_batch_size groups)
    max_response_length: int  # rollout.max_response_length: the length seq-mean-token-sum-norm divides by
    temperature: float  # rollout.temperature: the engines' sampling temperature the log-probs are of
    request_timeout_s: float  # rollout.request_timeout_s: how long a weight export waits for an engine
    num_threads: int  # trainer.num_threads: torch's CPU threads on each rank (0: torch's default)
    weight_bucket_mb: float  # trainer.weight_bucket_mb: the weights sent to the engines in buckets of this size
    sft_max_length: int  # sft.max_length: SFT's longest conversation, the length its loss divides by

    @classmethod
    def of(cls, cfg: RunConfig) -> PolicySettings:
        return cls(cfg.actor, cfg.model, cfg.algorithm, cfg.critic, cfg.seed, cfg.rollout.n,
                   cfg.rollout.max_response_length, cfg.rollout.temperature, cfg.rollout.request_timeout_s,
                   cfg.trainer.num_threads, cfg.trainer.weight_bucket_mb, cfg.sft.max_length)
