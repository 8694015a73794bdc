"""The RL loop, top to bottom: prompts -> rollouts -> rewards -> advantages -> update -> weight sync -> log."""

from __future__ import annotations

import os
import time
from pathlib import Path

import ray
import torch
from transformers import AutoTokenizer

from rl360.actor.batch import RolloutBatch, build_batch
from rl360.actor.policy import PolicyWorker
from rl360.algos.advantages import get_advantage_estimator
from rl360.cluster import WorkerGroup, start_ray
from rl360.config import RunConfig, to_dict
from rl360.data import PromptRenderer, PromptStream, scan_data_sources
from rl360.rewards import RewardItem, RewardPool, check_data_sources, register_reward_path
from rl360.rollout.base import SamplingParams
from rl360.rollout.hf_engine import HFEngine
from rl360.tracking.tracker import Tracker


def train(cfg: RunConfig) -> Path:
    """Run `cfg.trainer.total_steps` RL steps; returns the output directory."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    for prefix, path in cfg.reward.custom.items():
        register_reward_path(prefix, path)
    check_data_sources(scan_data_sources(cfg.data.train_files))  # unknown data_source: fail now
    renderer = PromptRenderer(tokenizer, cfg.data.max_prompt_length)
    stream = PromptStream(cfg.data.train_files, cfg.data.batch_size, seed=cfg.seed, shuffle=cfg.data.shuffle,
                          shuffle_buffer=cfg.data.shuffle_buffer, on_bad_row=cfg.data.on_bad_row,
                          filter_fn=renderer.fits)

    parallel = cfg.actor.parallel
    policy_ranks = parallel.tensor * parallel.pipeline * parallel.data
    start_ray(cfg.cluster.ray_address,
              cfg.cluster.num_cpus or max(os.cpu_count() or 1, policy_ranks + cfg.rollout.num_engines))
    use_gpu = torch.cuda.is_available()
    policy = WorkerGroup(PolicyWorker, policy_ranks, cfg, use_gpu=use_gpu, name="policy")
    engine = WorkerGroup(HFEngine, cfg.rollout.num_engines, cfg.model.path, use_gpu=use_gpu, name="rollout",
                         distributed=False, num_threads=cfg.trainer.num_threads).actors[0]
    rewards = RewardPool(cfg.reward.num_workers, cfg.reward.timeout_s,
                         int(cfg.reward.max_memory_gb * (1 << 30)) or None)
    tracker = Tracker(out, to_dict(cfg), cfg.tracking.wandb, cfg.tracking.project, cfg.tracking.run_name,
                      cfg.tracking.log_every)
    estimator = get_advantage_estimator(cfg.algorithm.adv_estimator)
    stop_ids = sorted({tokenizer.eos_token_id} - {None})
    batches = iter(stream)
    try:
        for step in range(1, cfg.trainer.total_steps + 1):
            started = time.perf_counter()
            timing: dict[str, float] = {}

            # 1. prompts
            rows = next(batches)
            prompt_ids = [renderer.render(row["prompt"]) for row in rows]

            # 2. rollouts: n samples per prompt, with the engine's log-probs
            with _timer(timing, "rollout"):
                params = SamplingParams(n=cfg.rollout.n, temperature=cfg.rollout.temperature,
                                        top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                                        max_new_tokens=cfg.rollout.max_response_length,
                                        stop_token_ids=stop_ids, seed=cfg.seed * 1_000_003 + step)
                groups = ray.get(engine.generate.remote(prompt_ids, params))
            samples = [sample for group in groups for sample in group]
            sample_rows = [row for row in rows for _ in range(cfg.rollout.n)]
            batch = build_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                [s.logprobs for s in samples], pad_id=tokenizer.pad_token_id or 0)

            # 3. rewards, by data_source, under a timeout
            with _timer(timing, "reward"):
                texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
                results = rewards.score([
                    RewardItem(row["data_source"], text, row["reward_model"]["ground_truth"], row.get("extra_info"))
                    for row, text in zip(sample_rows, texts)
                ])
            scores = torch.tensor([r.score for r in results], dtype=torch.float32)

            # 4. old / reference log-probs and advantages
            shards = _data_parallel_shards(batch, parallel.data)
            with _timer(timing, "logprobs"):
                batch.old_logprobs = torch.cat(policy.call_each("compute_logprobs", [(s,) for s in shards]))
                if cfg.algorithm.kl_coef > 0:
                    batch.ref_logprobs = torch.cat(
                        policy.call_each("compute_logprobs", [(s, True) for s in shards]))
            batch.advantages, _ = estimator(
                _token_level(scores, batch), batch.response_mask, [i // cfg.rollout.n for i in range(len(batch))],
                norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo, gamma=cfg.algorithm.gamma)

            # 5. policy update
            with _timer(timing, "update"):
                shards = _data_parallel_shards(batch, parallel.data)
                update_metrics = _merge_rank_metrics(policy.call_each("update", [(s,) for s in shards]))

            # 6. weights into the engine, in HF names and bounded buckets
            with _timer(timing, "weight_sync"):
                sync_weights(policy.actors[0], [engine], version=step)

            # 7. log
            metrics = {
                **_rollout_metrics(batch, scores),
                **rewards.last_metrics(),
                **update_metrics,
                **{f"timing/{k}_s": v for k, v in timing.items()},
                "data/epoch": stream.epoch,
                "timing/step_s": time.perf_counter() - started,
            }
            tracker.log(step, metrics)
        if cfg.trainer.save_hf:
            policy.call("save_hf", str(out / "hf"))
            tokenizer.save_pretrained(str(out / "hf"))
    finally:
        tracker.close()
        rewards.close()
    return out


def sync_weights(policy_rank0, engines: list, version: int) -> None:
    """Stream the policy's weights, bucket by bucket, into every engine, then check all were loaded."""
    pending = []
    for bucket_ref in policy_rank0.export_weights.options(num_returns="streaming").remote():
        pending += [engine.update_weights.remote(bucket_ref, version) for engine in engines]
    ray.get(pending)
    ray.get([engine.finish_weight_update.remote(version) for engine in engines])


def _data_parallel_shards(batch: RolloutBatch, ranks: int) -> list[RolloutBatch]:
    """Contiguous equal shards, one per data-parallel rank (TP = PP = 1: rank i is data-parallel rank i)."""
    size = len(batch) // ranks
    return [batch.select(slice(i * size, (i + 1) * size)) for i in range(ranks)]


# Metrics every rank computes identically; all others are each rank's share of a global mean, so they add up.
_SAME_ON_EVERY_RANK = ("actor/grad_norm", "actor/update_skipped")


def _merge_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    return {key: per_rank[0][key] if key in _SAME_ON_EVERY_RANK else sum(m[key] for m in per_rank)
            for key in per_rank[0]}


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
    }


class _timer:
    def __init__(self, sink: dict[str, float], name: str):
        self.sink, self.name = sink, name

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.sink[self.name] = time.perf_counter() - self.start
