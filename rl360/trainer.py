"""The RL loop, top to bottom: prompts -> rollouts -> rewards -> advantages -> update -> weight sync -> log."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from rl360.actor.batch import RolloutBatch
from rl360.actor.critic import CriticWorker
from rl360.actor.policy import PolicyWorker
from rl360.actor.policy_group import PolicyGroup
from rl360.actor.settings import PolicySettings
from rl360.agents.group import agent_group
from rl360.algos.advantages import compute_advantages, get_advantage_estimator, token_rewards
from rl360.algos.distillation import distill_advantages
from rl360.algos.dynamic_sampling import trained_rows
from rl360.algos.kl_control import KLController, kl_in_reward
from rl360.algos.losses import kl_penalty
from rl360.checkpointing import (
    ConvertInfo,
    latest_checkpoint,
    load_checkpoint,
    open_checkpoints,
    save_checkpoint,
    set_previous_run_aside,
)
from rl360.cluster import WorkerGroup, start_ray, stopped_by_signals
from rl360.cluster.placement import Placement, make_placement
from rl360.config import ConfigError, RunConfig, to_dict
from rl360.core.engine_kinds import engine_kind
from rl360.data import MixedPromptStream, PromptRenderer, PromptStream
from rl360.errors import RunStopped
from rl360.eval.during_training import TrainingEval
from rl360.plan import GIB, plan
from rl360.rewards.pool import open_reward_pool
from rl360.rollout.ahead import keep_ahead, restore_ahead
from rl360.rollout.sampler import RolloutSampler, SamplerSettings, StepRollouts
from rl360.run_checks import CheckedRun, check_run
from rl360.run_config import save_run_config
from rl360.stopping import StopSignals
from rl360.tracking.console import LOG_FILE, RunLog, dependency_note, plain_when_piped, quiet_known_warnings
from rl360.tracking.rollout_dump import due, dump_rollouts
from rl360.tracking.tracker import Tracker


def train(cfg: RunConfig, checked: CheckedRun | None = None) -> Path:
    """Run `cfg.trainer.total_steps` RL steps; returns the output directory. `checked`: `check_run(cfg)` when the
    caller already ran it (the CLI does, before importing this module)."""
    started = time.monotonic()
    with stopped_by_signals(Path(cfg.output_dir) / "checkpoints") as stop:
        return _train(cfg, checked, stop, started)


def _train(cfg: RunConfig, checked: CheckedRun | None, stop: StopSignals, started: float) -> Path:
    quiet_known_warnings()  # megatron's Transformer Engine / Apex notices: one line below instead, every process
    plain_when_piped()  # no colour codes in Ray's worker prefixes when stdout is not a terminal
    checked = checked or check_run(cfg)  # model directory, resume, custom rewards, agent, every data row
    out = checked.out
    out.mkdir(parents=True, exist_ok=True)
    # starting over: an earlier run's metrics, config, log and model are moved aside (its checkpoints below)
    notes = checked.resume_notes if checked.latest is not None else set_previous_run_aside(out, cfg.trainer.resume)
    save_run_config(out, cfg)
    with RunLog(out / LOG_FILE):  # what the console shows from here on, appended to train.log
        for line in [*notes, *filter(None, [dependency_note()])]:
            print(line, flush=True)
        return _run(cfg, out, checked.agent, checked.routes, started, stop)


def _run(cfg: RunConfig, out: Path, agent, routes, started: float, stop: StopSignals) -> Path:
    """The run itself, once its config and data have been checked and its output directory is its own."""
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    # multi-turn with tools (agent.loop=tools): each sample a trajectory of the agent loop; else one turn (a chat
    # template that cannot carry the tool replies is refused here)
    turns = {"generate_group": agent_group(agent, tokenizer)} if agent is not None else {}
    # reward workers with only the environment they need; a line says what isolation untrusted code gets, and
    # the run refuses to start when the data runs code that the sandbox here cannot isolate
    rewards = open_reward_pool(cfg.reward, routes)
    steps = None
    # on the way out: the tracker, the rollout sampler, the policy's and critic's ranks, the reward pool
    with contextlib.ExitStack() as closing:
        closing.callback(rewards.close)
        try:
            # a Qwen2-VL / Qwen2.5-VL model (config.json model_type) renders image rows as ImagePrompts
            renderer = PromptRenderer.for_model(cfg.model.path, tokenizer, cfg.data.max_prompt_length)
            stream = _prompt_stream(cfg, renderer)
            placement = _place(cfg, stop)
            # the policy (and critic) ranks build in their processes while the engines start below
            policy, critic = _workers(cfg, placement)
            closing.callback(policy.shutdown)  # last: after the engines, which may still read its weights
            if critic is not None:
                closing.callback(critic.shutdown)
            # the prompt stream, the engines and the reward pool; generate(step) runs beside the trainer
            rollouts = RolloutSampler(SamplerSettings.of(cfg), tokenizer, stream, renderer, rewards, policy, placement,
                                      **turns)
            closing.callback(rollouts.close)
            attention = policy.call("attention_backend")[0]  # what model.attention (auto: te or torch) resolved to
            why = f" ({policy.call('attention_reason')[0]})" if cfg.model.attention == "auto" else ""
            print(f"policy layer spec: model.attention={cfg.model.attention} -> {attention}{why}", flush=True)
            # data.val_files, sampled between steps by the engines
            evaluation = TrainingEval(cfg.validation, cfg.data, cfg.rollout, cfg.seed, cfg.trainer.total_steps,
                                      renderer, rollouts, out)
            steps = _Steps(cfg, out, tokenizer, policy, critic, rollouts, evaluation, stop)
            resumed = steps.resume()
            run_config = {**to_dict(cfg), "resolved": {
                "model.attention": attention, "placement": placement.describe(),
                "rollout.colocate": placement.colocate, "rollout.weight_sync": placement.weight_sync}}
            steps.tracker = Tracker(
                out, run_config, cfg.tracking.wandb, cfg.tracking.project, cfg.tracking.run_name,
                cfg.tracking.log_every, resume_after_step=steps.first_step - 1 if resumed else None,
                total_steps=cfg.trainer.total_steps, started=started, use_swanlab=cfg.tracking.swanlab,
                use_tensorboard=cfg.tracking.tensorboard)
            closing.callback(steps.tracker.close)
            if cfg.validation.before_train and resumed is None:  # the starting weights, logged as step 0
                steps.tracker.log(0, evaluation.run(0))
            steps.run()
        except Exception as err:  # stopping, its workers signalled too (Slurm signals every process of a job)
            if not stop.requested or isinstance(err, RunStopped):
                raise
            raise stop.stopped(steps.done if steps is not None else 0, latest_checkpoint(out / "checkpoints"),
                               f" (the run failed while stopping: {type(err).__name__}, in train.log)") from err
    return out


def _prompt_stream(cfg: RunConfig, renderer: PromptRenderer) -> PromptStream | MixedPromptStream:
    stream_kwargs = dict(seed=cfg.seed, shuffle=cfg.data.shuffle, shuffle_buffer=cfg.data.shuffle_buffer,
                         on_bad_row=cfg.data.on_bad_row, filter_fn=renderer.fits)
    if cfg.data.mix_weights:  # sample data_source prefixes in these proportions
        return MixedPromptStream.by_data_source(cfg.data.train_files, cfg.data.mix_weights, cfg.data.batch_size,
                                                **stream_kwargs)
    return PromptStream(cfg.data.train_files, cfg.data.batch_size, **stream_kwargs)


def _place(cfg: RunConfig, stop: StopSignals) -> Placement:
    """Ray started, and who runs on which GPU, decided once from the settings and the cluster's GPUs (refused here,
    in seconds, when it cannot fit): colocation and the weight sync it needs are the placement's, passed on to
    whatever reads them (the config keeps what was asked)."""
    policy_ranks = cfg.actor.parallel.ranks
    use_critic = cfg.algorithm.uses_critic
    in_process_engines = cfg.rollout.num_engines if engine_kind(cfg.rollout.engine).in_process else 0
    gpus = start_ray(cfg.cluster.ray_address, cfg.cluster.num_cpus or max(
        os.cpu_count() or 1, policy_ranks * (2 if use_critic else 1) + in_process_engines), cfg.cluster.num_gpus)
    stop.install()  # again: ray.init replaced the SIGTERM handler with its own
    placement = make_placement(policy_ranks, use_critic, cfg.rollout, gpus)
    print(placement.describe(), flush=True)
    memory_gb = cfg.cluster.gpu_memory_gb or (torch.cuda.get_device_properties(0).total_memory / GIB
                                              if torch.cuda.is_available() else 0)
    if placement.use_gpu and memory_gb and cfg.trainer.memory_check:
        # a layout that cannot fit stops here, not at an OOM an hour in
        problem = plan(cfg, memory_gb, placement).problem()
        if problem is not None:
            raise ConfigError(f"{problem}; `rl360 plan` prints every term (trainer.memory_check=false to "
                              "start anyway)")
    return placement


def _workers(cfg: RunConfig, placement: Placement) -> tuple[PolicyGroup, PolicyGroup | None]:
    """The policy's ranks, and the critic's (PPO's gae) where the placement has them, on the same layout."""
    groups = dict(use_gpu=placement.use_gpu, timeout_s=cfg.cluster.placement_timeout_s, colocated=placement.colocate)
    settings = PolicySettings.of(cfg)  # what every rank reads of the config, the policy's and the critic's alike
    policy = PolicyGroup(WorkerGroup(PolicyWorker, placement.policy_ranks, settings, name="policy",
                                     share=placement.gpu_share, **groups))
    critic = PolicyGroup(WorkerGroup(CriticWorker, placement.critic_ranks, settings, name="critic", **groups)) \
        if placement.critic_ranks else None
    return policy, critic


class _Steps:
    """The run's steps over its built parts, from the first (or the resumed) step to the last, and its
    checkpoints. `done`: the last step completed."""

    def __init__(self, cfg: RunConfig, out: Path, tokenizer, policy: PolicyGroup, critic: PolicyGroup | None,
                 rollouts: RolloutSampler, evaluation: TrainingEval, stop: StopSignals):
        self.cfg, self.out, self.tokenizer, self.stop = cfg, out, tokenizer, stop
        self.policy, self.critic, self.rollouts, self.evaluation = policy, critic, rollouts, evaluation
        algo = cfg.algorithm
        self.estimator = get_advantage_estimator(algo.adv_estimator)
        self.kl_control = KLController(algo.kl_in_reward_coef, algo.kl_in_reward_target, algo.kl_in_reward_horizon)
        self.models = {"policy": policy, **({"critic": critic} if critic is not None else {})}
        self.checkpoints = out / "checkpoints"
        self.tracker: Tracker | None = None
        self.first_step, self.done = 1, 0
        # async: step -> the future of its rollouts, for the steps generated ahead of the one training
        self.generating: dict[int, concurrent.futures.Future] = {}
        self.ahead = cfg.rollout.max_staleness if cfg.rollout.mode == "async" else 0

    def resume(self) -> Path | None:
        """Resuming: what the interrupted run wrote after `latest` goes; starting over: another run's checkpoints
        are moved aside whole (printed), never pruned or overwritten. Returns the checkpoint resumed from."""
        resumed = open_checkpoints(self.checkpoints, self.cfg.trainer.resume)
        if resumed is not None:  # weights, optimizer, data position, KL coefficient; then the engines catch up
            state = load_checkpoint(resumed, self.models)
            # async: the steps drawn ahead before the checkpoint, kept in it, are trained on as they were drawn
            self.generating, data, ahead_note = restore_ahead(resumed, self.cfg, state["data"])
            self.rollouts.load_data_state(data)
            self.kl_control.coef = state["kl_coef"]
            self.first_step = state["step"] + 1
            self.rollouts.sync_weights(version=state["step"])
            print(f"resumed from {resumed} at step {self.first_step}", flush=True)
            if ahead_note:
                print(ahead_note, flush=True)
        return resumed

    def run(self) -> None:
        cfg, total = self.cfg, self.cfg.trainer.total_steps
        self.done = self.first_step - 1
        for step in range(self.first_step, total + 1):
            if self.stop.requested:
                break
            started = time.perf_counter()
            drawn = self.draw(step)
            if drawn is None:
                break
            self.tracker.log(step, self.train(step, drawn, started))
            self.done = step
            # 8. a resumable checkpoint now and then, and at the end (the data position before the next
            #    step's prompts; async: the steps already under way, waited for and kept with it)
            every = cfg.trainer.save_every
            if every and (step % every == 0 or step == total):
                self.save(step)
        if self.done < total:  # stopped by a signal: a checkpoint of the last step completed
            latest = latest_checkpoint(self.checkpoints)
            if self.done >= self.first_step and (latest is None or latest.name != f"step_{self.done:06d}"):
                latest = self.save(self.done)
            raise self.stop.stopped(self.done, latest)
        if cfg.trainer.save_hf:  # data-parallel replicas hold the same weights: replica 0 writes them
            self.policy.save_hf(str(self.out / "hf"))
            self.tokenizer.save_pretrained(str(self.out / "hf"))

    def draw(self, step: int) -> StepRollouts | None:
        """1-3. prompts -> n rollouts each (with the engine's log-probs) -> rewards by data_source, from the
        rollout sampler (DAPO's dynamic sampling and ReMax's greedy baselines happen there too); async: the next
        `ahead` steps' rollouts are generated while this step trains. None: stopped while waiting."""
        for upcoming in range(step, min(step + self.ahead, self.cfg.trainer.total_steps) + 1):
            if upcoming not in self.generating:
                self.generating[upcoming] = self.rollouts.generate(upcoming)
        # a stop during a rollout abandons it when no step is drawn ahead (a resume draws it again, the same)
        drawn = self.generating[step].result() if self.ahead else self.stop.wait_for(self.generating[step])
        if drawn is None:
            self.generating.pop(step).cancel()
            return None
        self.generating.pop(step)
        return drawn

    def train(self, step: int, drawn: StepRollouts, started: float) -> dict[str, float]:
        """Steps 4-7 on the step's rollouts; returns the step's metrics."""
        algo = self.cfg.algorithm
        timing = {"rollout_wait": time.perf_counter() - started, **drawn.timing}
        scored, sampling_metrics = drawn.scored, drawn.metrics
        sampled = scored.batch(self.tokenizer.pad_token_id or 0)
        # partial dynamic filtering: advantages over whole groups (below), the update on the kept trajectories
        batch, scores = trained_rows(sampled, scored.scores, scored.train_mask)
        # 4. old / reference log-probs (and PPO's values) and advantages
        with _timer(timing, "logprobs"):
            self.logprobs(batch)
        if due(self.cfg.trainer.dump_rollouts_every, step):  # prompts, responses, scores, log-prob differences
            dump_rollouts(self.out, step, scored.samples, scored.rows, scores, batch, self.tokenizer.decode,
                          scored.train_mask)
        rewards = token_rewards(scored.scores, sampled.response_mask)
        if algo.kl_in_reward_coef > 0:  # KL penalty in the reward, per token
            rewards, kl_metrics = kl_in_reward(rewards, batch, self.kl_control, algo.kl_estimator)
            sampling_metrics.update(kl_metrics)
        batch.advantages, batch.returns = compute_advantages(
            self.estimator, rewards, sampled.response_mask, self.cfg.rollout.n, algo, drawn.baselines, batch.values,
            keep=scored.train_mask)
        if batch.teacher_logprobs is not None:  # on-policy distillation: the per-token reverse KL to the teacher
            batch.advantages, distill_metrics = distill_advantages(
                batch.advantages, batch.teacher_logprobs, batch.old_logprobs, batch.response_mask,
                self.cfg.distill.coef, self.cfg.distill.reward_weight)
            sampling_metrics.update(distill_metrics)
        # 5. critic and policy updates (shards again: they now carry log-probs, advantages, returns)
        update_metrics = self.update(step, batch, timing)
        # 6. weights into the engines, in HF names and bounded buckets (async: requests in flight end
        #    first, or with rollout.partial are aborted and continued under the new weights)
        with _timer(timing, "weight_sync"):
            sync_metrics = self.rollouts.sync_weights(version=step)
        # 7. held-out evaluation when due (validation.every, validation.at_end) of the weights just synced, and log
        return {
            **self.evaluation.at(step),
            **_rollout_metrics(batch, scores),
            **sampling_metrics,
            **update_metrics,
            **sync_metrics,
            **{f"timing/{k}_s": v for k, v in timing.items()},
            "timing/step_s": time.perf_counter() - started,
        }

    def logprobs(self, batch: RolloutBatch) -> None:
        """The trainer's log-probs of the sampled tokens, the reference model's when a KL needs them, the critic's
        values when there is one."""
        algo = self.cfg.algorithm
        batch.old_logprobs = torch.cat(self.policy.shard_call("compute_logprobs", batch))
        if algo.kl_coef > 0 or algo.kl_in_reward_coef > 0:
            batch.ref_logprobs = torch.cat(self.policy.shard_call("compute_logprobs", batch, True))
        if self.critic is not None:
            batch.values = torch.cat(self.critic.shard_call("compute_values", batch))

    def update(self, step: int, batch: RolloutBatch, timing: dict[str, float]) -> dict[str, float]:
        metrics = {}
        if self.critic is not None:
            with _timer(timing, "critic_update"):
                metrics.update(_merge_rank_metrics(self.critic.shard_call("update", batch)))
        if self.critic is None or step > self.cfg.critic.warmup_steps:
            with _timer(timing, "update"):
                metrics.update(_merge_rank_metrics(self.policy.shard_call("update", batch)))
        return metrics

    def save(self, step: int) -> Path:
        cfg, parallel = self.cfg, self.cfg.actor.parallel
        data, extra = keep_ahead(self.generating, self.rollouts, step, cfg)
        return save_checkpoint(self.checkpoints, step, self.models, {"data": data, "kl_coef": self.kl_control.coef},
                               cfg.trainer.keep_checkpoints, ConvertInfo(cfg.model.path, parallel.tensor,
                                                                         parallel.pipeline, cfg.model.dtype), extra)


# Metrics every rank computes identically; all others are each rank's share of a global mean, so they add up.
_SAME_ON_EVERY_RANK = ("actor/grad_norm", "actor/update_skipped", "critic/grad_norm", "critic/update_skipped")


def _merge_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    return {key: per_rank[0][key] if key in _SAME_ON_EVERY_RANK else sum(m[key] for m in per_rank)
            for key in per_rank[0]}


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
