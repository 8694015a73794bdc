"""The RL loop, top to bottom: prompts -> rollouts -> rewards -> advantages -> update -> weight sync -> log."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import ray
import torch
from transformers import AutoTokenizer

from rl360.actor.batch import RolloutBatch, build_batch
from rl360.actor.critic import CriticWorker
from rl360.actor.policy import PolicyWorker
from rl360.actor.policy_group import PolicyGroup
from rl360.algos.advantages import get_advantage_estimator
from rl360.algos.dynamic_sampling import overlong_penalty, varied_groups
from rl360.algos.kl_control import KLController
from rl360.algos.losses import kl_penalty
from rl360.checkpointing import ConvertInfo, load_checkpoint, open_checkpoints, save_checkpoint
from rl360.cluster import WorkerGroup, start_ray
from rl360.config import RunConfig, to_dict
from rl360.data import MixedPromptStream, PromptRenderer, PromptStream
from rl360.rewards import RewardItem, RewardPool, register_reward_path
from rl360.rewards.check import check_reward_data, judge_configured
from rl360.rewards.pool import open_reward_pool
from rl360.rollout.base import Sample, SamplingParams
from rl360.rollout.hf_engine import HFEngine
from rl360.tracking.tracker import Tracker


def train(cfg: RunConfig) -> Path:
    """Run `cfg.trainer.total_steps` RL steps; returns the output directory."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    for prefix, path in cfg.reward.custom.items():
        register_reward_path(prefix, path)
    # unknown data_source or reward_metric, or a judge-scored row without reward.judge: fail now
    routes = check_reward_data(cfg.data.train_files, judge_configured(cfg.reward.judge))
    # reward workers with only the environment they need; a line says what isolation untrusted code gets, and
    # the run refuses to start when the data runs code that the sandbox here cannot isolate
    rewards = open_reward_pool(cfg.reward, routes)
    tracker = None
    try:
        renderer = PromptRenderer(tokenizer, cfg.data.max_prompt_length)
        stream_kwargs = dict(seed=cfg.seed, shuffle=cfg.data.shuffle, shuffle_buffer=cfg.data.shuffle_buffer,
                             on_bad_row=cfg.data.on_bad_row, filter_fn=renderer.fits)
        if cfg.data.mix_weights:  # sample data_source prefixes in these proportions
            stream = MixedPromptStream.by_data_source(cfg.data.train_files, cfg.data.mix_weights, cfg.data.batch_size,
                                                      **stream_kwargs)
        else:
            stream = PromptStream(cfg.data.train_files, cfg.data.batch_size, **stream_kwargs)

        parallel = cfg.actor.parallel
        policy_ranks = parallel.tensor * parallel.pipeline * parallel.data
        use_critic = cfg.algorithm.adv_estimator == "gae"
        start_ray(cfg.cluster.ray_address, cfg.cluster.num_cpus or max(
            os.cpu_count() or 1, policy_ranks * (2 if use_critic else 1) + cfg.rollout.num_engines))
        use_gpu = torch.cuda.is_available()
        policy = PolicyGroup(WorkerGroup(PolicyWorker, policy_ranks, cfg, use_gpu=use_gpu, name="policy"))
        critic = PolicyGroup(WorkerGroup(CriticWorker, policy_ranks, cfg, use_gpu=use_gpu, name="critic")) \
            if use_critic else None
        engine = WorkerGroup(HFEngine, cfg.rollout.num_engines, cfg.model.path, use_gpu=use_gpu, name="rollout",
                             distributed=False, num_threads=cfg.trainer.num_threads).actors[0]
        estimator = get_advantage_estimator(cfg.algorithm.adv_estimator)
        kl_control = KLController(cfg.algorithm.kl_in_reward_coef, cfg.algorithm.kl_in_reward_target,
                                  cfg.algorithm.kl_in_reward_horizon)
        models = {"policy": policy, **({"critic": critic} if critic is not None else {})}
        checkpoints = out / "checkpoints"
        # resuming: what the interrupted run wrote after `latest` goes; starting over: another run's checkpoints
        # are moved aside whole (printed), never pruned or overwritten
        resumed = open_checkpoints(checkpoints, cfg.trainer.resume)
        first_step = 1
        if resumed is not None:  # weights, optimizer, data position, KL coefficient; then the engine catches up
            state = load_checkpoint(resumed, models)
            stream.load_state_dict(state["data"])
            kl_control.coef = state["kl_coef"]
            first_step = state["step"] + 1
            sync_weights(policy, [engine], version=state["step"])
            print(f"resumed from {resumed} at step {first_step}", flush=True)
        tracker = Tracker(out, to_dict(cfg), cfg.tracking.wandb, cfg.tracking.project, cfg.tracking.run_name,
                          cfg.tracking.log_every, resume_after_step=first_step - 1 if resumed else None)
        batches = iter(stream)
        skipped = stream.skipped()  # rows left out so far (restored with the data position on resume)
        for step in range(first_step, cfg.trainer.total_steps + 1):
            started = time.perf_counter()
            timing: dict[str, float] = {}

            # 1-3. prompts -> n rollouts each (with the engine's log-probs) -> rewards by data_source;
            #      with DAPO dynamic sampling, only groups whose scores vary, sampling more until full
            scored, sampling_metrics = collect_groups(batches, engine, rewards, renderer, tokenizer, cfg, step,
                                                      timing)
            batch, scores = scored.batch(tokenizer.pad_token_id or 0), scored.scores
            baselines = None
            if cfg.algorithm.adv_estimator == "remax":  # ReMax: a greedy response's score per prompt
                baselines = greedy_baselines(scored, engine, rewards, renderer, tokenizer, cfg, timing,
                                             sampling_metrics)

            # 4. old / reference log-probs (and PPO's values) and advantages
            with _timer(timing, "logprobs"):
                batch.old_logprobs = torch.cat(policy.shard_call("compute_logprobs", batch))
                if cfg.algorithm.kl_coef > 0 or cfg.algorithm.kl_in_reward_coef > 0:
                    batch.ref_logprobs = torch.cat(policy.shard_call("compute_logprobs", batch, True))
                if critic is not None:
                    batch.values = torch.cat(critic.shard_call("compute_values", batch))
            token_rewards = _token_level(scores, batch)
            if cfg.algorithm.kl_in_reward_coef > 0:  # KL penalty in the reward, per token
                token_kl = kl_penalty(batch.old_logprobs, batch.ref_logprobs, cfg.algorithm.kl_estimator)
                token_kl = token_kl * batch.response_mask
                token_rewards = token_rewards - kl_control.coef * token_kl
                sequence_kl = token_kl.sum(-1).mean().item()
                sampling_metrics.update({"reward/kl": sequence_kl, "reward/kl_coef": kl_control.coef})
                kl_control.update(sequence_kl, len(batch))
            batch.advantages, batch.returns = estimator(
                token_rewards, batch.response_mask, [i // cfg.rollout.n for i in range(len(batch))],
                norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo, gamma=cfg.algorithm.gamma,
                lam=cfg.algorithm.lam, reward_baselines=baselines, values=batch.values)

            # 5. critic and policy updates (shards again: they now carry log-probs, advantages, returns)
            update_metrics = {}
            if critic is not None:
                with _timer(timing, "critic_update"):
                    update_metrics.update(_merge_rank_metrics(critic.shard_call("update", batch)))
            if critic is None or step > cfg.critic.warmup_steps:
                with _timer(timing, "update"):
                    update_metrics.update(_merge_rank_metrics(policy.shard_call("update", batch)))

            # 6. weights into the engine, in HF names and bounded buckets
            with _timer(timing, "weight_sync"):
                sync_weights(policy, [engine], version=step)

            # 7. log
            metrics = {
                **_rollout_metrics(batch, scores),
                **sampling_metrics,
                **update_metrics,
                **{f"timing/{k}_s": v for k, v in timing.items()},
                "data/epoch": stream.epoch,
                **_skipped_metrics(stream.skipped(), skipped),
                "timing/step_s": time.perf_counter() - started,
            }
            skipped = stream.skipped()
            tracker.log(step, metrics)

            # 8. a resumable checkpoint now and then, and at the end
            every = cfg.trainer.save_every
            if every and (step % every == 0 or step == cfg.trainer.total_steps):
                save_checkpoint(checkpoints, step, models, {"data": stream.state_dict(), "kl_coef": kl_control.coef},
                                cfg.trainer.keep_checkpoints, ConvertInfo(cfg.model.path, parallel.tensor,
                                                                          parallel.pipeline, cfg.model.dtype))
        if cfg.trainer.save_hf:  # data-parallel replicas hold the same weights: replica 0 writes them
            policy.save_hf(str(out / "hf"))
            tokenizer.save_pretrained(str(out / "hf"))
    finally:
        if tracker is not None:
            tracker.close()
        rewards.close()
    return out


@dataclass
class Scored:
    """Sampled responses with their prompts' rows and their scores, `n` consecutive samples per prompt."""

    rows: list[dict]  # one per sample
    samples: list[Sample]
    scores: torch.Tensor  # [num samples], trained on (overlong penalty included)
    accuracy: torch.Tensor  # [num samples], the reward's "acc" extra where it gives one, else its score
    n: int

    @property
    def num_groups(self) -> int:
        return len(self.samples) // self.n

    def select_groups(self, keep: torch.Tensor) -> Scored:
        rows = [i for g in keep.nonzero().flatten().tolist() for i in range(g * self.n, (g + 1) * self.n)]
        return Scored([self.rows[i] for i in rows], [self.samples[i] for i in rows], self.scores[rows],
                      self.accuracy[rows], self.n)

    def first_groups(self, count: int) -> Scored:
        return self.select_groups(torch.arange(self.num_groups) < count)

    @staticmethod
    def concat(parts: list[Scored]) -> Scored:
        return Scored([r for p in parts for r in p.rows], [s for p in parts for s in p.samples],
                      torch.cat([p.scores for p in parts]), torch.cat([p.accuracy for p in parts]), parts[0].n)

    def batch(self, pad_id: int) -> RolloutBatch:
        return build_batch([s.prompt_ids for s in self.samples], [s.response_ids for s in self.samples],
                           [s.logprobs for s in self.samples], pad_id=pad_id)


def collect_groups(batches, engine, rewards: RewardPool, renderer: PromptRenderer, tokenizer, cfg: RunConfig,
                   step: int, timing: dict[str, float]) -> tuple[Scored, dict[str, float]]:
    """`data.batch_size` scored prompt groups for one step, and the step's sampling metrics.

    Without dynamic sampling: one prompt batch. With it (DAPO): groups whose scores are all equal are set
    aside and more prompt batches are sampled; after `max_num_gen_batches` the step fills up with set-aside
    groups (no signal under group-centred advantages) and counts them."""
    algo = cfg.algorithm
    kept: list[Scored] = []
    uniform: list[Scored] = []
    sampled: list[torch.Tensor] = []  # every score of the step, trained on or not
    metrics: dict[str, float] = {}
    gen_batches = filled = 0
    while sum(g.num_groups for g in kept) < cfg.data.batch_size:
        if gen_batches and algo.max_num_gen_batches and gen_batches >= algo.max_num_gen_batches:
            filled = cfg.data.batch_size - sum(g.num_groups for g in kept)
            kept += uniform
            break
        gen_batches += 1
        scored = rollout_and_score(next(batches), engine, rewards, renderer, tokenizer, cfg,
                                   seed=cfg.seed * 1_000_003 + step + 7_919 * (gen_batches - 1), timing=timing,
                                   metrics=metrics)
        sampled.append(scored.scores)
        if algo.filter_groups:
            metric = scored.accuracy if algo.filter_groups_metric == "acc" else scored.scores
            varied = varied_groups(metric, cfg.rollout.n)
            kept.append(scored.select_groups(varied))
            uniform.append(scored.select_groups(~varied))
        else:
            kept.append(scored)
    metrics.update({"reward/mean_sampled": torch.cat(sampled).mean().item(),
                    "dynamic_sampling/gen_batches": gen_batches, "dynamic_sampling/filled_groups": filled})
    return Scored.concat(kept).first_groups(cfg.data.batch_size), metrics


def rollout_and_score(rows: list[dict], engine, rewards: RewardPool, renderer: PromptRenderer, tokenizer,
                      cfg: RunConfig, seed: int, timing: dict[str, float],
                      metrics: dict[str, float]) -> Scored:
    """`rollout.n` responses for each prompt row, scored by its data_source's reward under a timeout;
    reward counts are added to `metrics`."""
    n = cfg.rollout.n
    with _timer(timing, "rollout"):
        params = SamplingParams(n=n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                top_k=cfg.rollout.top_k, max_new_tokens=cfg.rollout.max_response_length,
                                stop_token_ids=sorted({tokenizer.eos_token_id} - {None}), seed=seed)
        groups = ray.get(engine.generate.remote([renderer.render(row["prompt"]) for row in rows], params))
    samples = [sample for group in groups for sample in group]
    sample_rows = [row for row in rows for _ in range(n)]
    with _timer(timing, "reward"):
        texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        results = rewards.score([
            RewardItem(row["data_source"], text, row["reward_model"]["ground_truth"], row.get("extra_info"))
            for row, text in zip(sample_rows, texts)
        ])
    scores = torch.tensor([r.score for r in results], dtype=torch.float32)
    accuracy = torch.tensor([float(r.extras.get("acc", r.score)) for r in results], dtype=torch.float32)
    counts = rewards.last_metrics()
    if cfg.reward.overlong_buffer_len:
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        penalty = overlong_penalty(lengths, cfg.rollout.max_response_length, cfg.reward.overlong_buffer_len,
                                   cfg.reward.overlong_penalty_factor)
        scores = scores + penalty
        counts["reward/overlong_penalized"] = int((penalty < 0).sum())
    for key, value in counts.items():
        metrics[key] = metrics.get(key, 0) + value
    return Scored(sample_rows, samples, scores, accuracy, n)


def greedy_baselines(scored: Scored, engine, rewards: RewardPool, renderer: PromptRenderer, tokenizer,
                     cfg: RunConfig, timing: dict[str, float], metrics: dict[str, float]) -> torch.Tensor:
    """[num samples] ReMax baselines: each prompt's greedy (temperature 0) response, scored like the samples
    and repeated for the prompt's `n` samples. The greedy responses are not trained on; their reward calls,
    timeouts and errors count in `metrics` with the samples'."""
    greedy_cfg = replace(cfg, rollout=replace(cfg.rollout, n=1, temperature=0.0))
    greedy = rollout_and_score(scored.rows[::scored.n], engine, rewards, renderer, tokenizer, greedy_cfg, seed=0,
                               timing=timing, metrics=metrics)
    metrics["reward/greedy_baseline_mean"] = greedy.scores.mean().item()
    return greedy.scores.repeat_interleave(scored.n)


def sync_weights(policy: PolicyGroup, engines: list, version: int) -> None:
    """Stream the policy's weights, bucket by bucket, into every engine, then check all were loaded."""
    pending = []
    for bucket_ref in policy.export_weights():
        pending += [engine.update_weights.remote(bucket_ref, version) for engine in engines]
    ray.get(pending)
    ray.get([engine.finish_weight_update.remote(version) for engine in engines])


# Metrics every rank computes identically; all others are each rank's share of a global mean, so they add up.
_SAME_ON_EVERY_RANK = ("actor/grad_norm", "actor/update_skipped", "critic/grad_norm", "critic/update_skipped")


def _merge_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    return {key: per_rank[0][key] if key in _SAME_ON_EVERY_RANK else sum(m[key] for m in per_rank)
            for key in per_rank[0]}


def _skipped_metrics(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """Rows the data stream left out in this step (bad rows under data.on_bad_row=skip; prompts over
    data.max_prompt_length) and since the run began."""
    names = {"bad_rows": "bad_rows", "filtered": "too_long"}
    return {**{f"data/skipped_{names[k]}": now[k] - before[k] for k in names},
            **{f"data/skipped_{names[k]}_total": now[k] for k in names}}


def _token_level(scores: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    """Each response's score on its last token, zeros elsewhere: `[batch, response_len]`."""
    rewards = torch.zeros_like(batch.response_mask)
    last = (batch.response_mask.sum(-1).long() - 1).clamp(min=0)
    rewards[torch.arange(len(batch)), last] = scores
    return rewards


def _rollout_metrics(batch: RolloutBatch, scores: torch.Tensor) -> dict[str, float]:
    mask = batch.response_mask
    lengths = mask.sum(-1)
    diff = (batch.old_logprobs - batch.rollout_logprobs).abs() * mask
    return {
        "reward/mean": scores.mean().item(),
        "reward/max": scores.max().item(),
        "reward/min": scores.min().item(),
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "rollout/logprob_abs_diff": (diff.sum() / mask.sum().clamp(min=1)).item(),
        "rollout/logprob_abs_diff_max": diff.max().item(),
        # k3 estimate of KL(engine || trainer) over the sampled tokens: the training-inference mismatch
        "rollout/k3_kl": ((kl_penalty(batch.rollout_logprobs, batch.old_logprobs, "k3") * mask).sum()
                          / mask.sum().clamp(min=1)).item(),
    }


class _timer:
    def __init__(self, sink: dict[str, float], name: str):
        self.sink, self.name = sink, name

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):  # adds up when a phase runs several times in a step
        self.sink[self.name] = self.sink.get(self.name, 0.0) + time.perf_counter() - self.start
