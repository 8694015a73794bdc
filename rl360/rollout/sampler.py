"""The training sampler: a step's scored prompt groups from the prompt stream, the engine fleet and the reward pool.

    sampler = RolloutSampler(SamplerSettings.of(cfg), tokenizer, stream, renderer, rewards, policy, placement)
    future = sampler.generate(step)      # a concurrent.futures.Future of StepRollouts, computed meanwhile
    sampler.sync_weights(step)           # the policy's weights into every engine, version `step`
    sampler.data_state(next_step)        # the stream position before `next_step`'s prompts (for checkpoints)
    sampler.run(sampler.sample(rows, rollout, seed))  # rows sampled on the sampler's thread (evaluation)
    sampler.score(items)                 # reward items scored by the run's pool (evaluation)
    sampler.close()

It lives in the trainer's process on an event-loop thread of its own (engine requests are asyncio), so
`generate` runs while the trainer trains: async training is `generate(step + k)` issued before step's update
(k <= rollout.max_staleness). Several steps may generate at once; they take turns at the prompt stream in the
order `generate` was called (a step with dynamic sampling keeps its turn until its last batch is drawn), so the
data order does not depend on timing. The stream, the reward pool and the tokenizer are used by that thread only.

The engines are an `EngineFleet` (rl360/rollout/fleet.py: start, restarts, least-loaded dispatch, pause and
continue, memory, weight sync). A prompt batch's samples come from one pluggable function,
`generate_group(fleet, prompts, params, seed, metrics, rows) -> list[list[Sample]]` (`params.n` samples per prompt,
sample j of prompt i seeded `seed + i * n + j`); the default is the fleet's dispatch, `fleet.generate`; an
agent loop can take its place. Samples are scored once, after the whole batch has come back.

Per step: groups of `rollout.n`, DAPO's dynamic sampling (`algorithm.filter_groups`), ReMax's greedy baselines,
the overlong penalty, and the metrics `rollout/staleness_*`, `rollout/truncated_frac`, `rollout/aborted` (samples
cut by an update, or by an engine), `rollout/resumed`, `rollout/mixed_version_frac`, `rollout/engine<i>_prompts`,
`rollout/engine_restarts` (since the previous step's metrics) and `_total`, `rollout/engines_released` (colocate).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from rl360.actor.batch import RolloutBatch, build_batch
from rl360.algos.dynamic_sampling import group_std, most_varied, overlong_penalty, partial_keep, varied_groups
from rl360.cluster.placement import Placement
from rl360.config import AlgorithmConfig, ConfigError, DistillConfig, ModelConfig, RolloutConfig, RunConfig
from rl360.core import Prompt, Sample, SamplingParams, TrajectorySummary
from rl360.rewards import RewardItem, RewardPool, RewardResult
from rl360.rollout.fleet import EngineFleet
from rl360.rollout.teacher import Teacher

CLOSE_TIMEOUT_S = 30  # how long `close` waits for the steps still generating to end once cancelled
# a prompt batch's samples: (fleet, prompts, params, seed, the step's metrics, the prompts' rows) -> params.n
# samples per prompt
GenerateGroup = Callable[[EngineFleet, list[Prompt], SamplingParams, int, dict[str, float], list[dict]],
                         Awaitable[list[list[Sample]]]]


async def dispatch(fleet: EngineFleet, prompts: list[Prompt], params: SamplingParams, seed: int,
                   metrics: dict[str, float], rows: list[dict] | None = None) -> list[list[Sample]]:
    """The default `generate_group`: one turn per sample, on the fleet's least-loaded engines (the prompts'
    `rows` are not needed)."""
    return await fleet.generate(prompts, params, seed, metrics)


@dataclass(frozen=True)
class SamplerSettings:
    """What the sampler reads of a run's config: the rollout, model, algorithm and distill sections whole, and the
    few other settings it needs."""

    rollout: RolloutConfig
    model: ModelConfig
    algorithm: AlgorithmConfig  # the advantage estimator (ReMax's greedy baselines) and dynamic sampling
    distill: DistillConfig
    batch_size: int  # data.batch_size: prompt groups a step
    seed: int
    moe_routing_replay: bool  # actor.moe_routing_replay: the engines return each token's routed experts
    overlong_buffer_len: int  # reward.overlong_buffer_len (0: no overlong penalty)
    overlong_penalty_factor: float  # reward.overlong_penalty_factor
    num_threads: int  # trainer.num_threads: an in-process engine's torch threads
    placement_timeout_s: float  # cluster.placement_timeout_s
    engine_dir: Path  # the engines' and the teacher's logs: output_dir/rollout

    @classmethod
    def of(cls, cfg: RunConfig) -> SamplerSettings:
        return cls(cfg.rollout, cfg.model, cfg.algorithm, cfg.distill, cfg.data.batch_size, cfg.seed,
                   cfg.actor.moe_routing_replay, cfg.reward.overlong_buffer_len, cfg.reward.overlong_penalty_factor,
                   cfg.trainer.num_threads, cfg.cluster.placement_timeout_s, Path(cfg.output_dir) / "rollout")


@dataclass
class Scored:
    """Sampled responses with their prompts' rows and their scores, `n` consecutive samples per prompt."""

    rows: list[dict]  # one per sample
    samples: list[Sample]
    scores: torch.Tensor  # [num samples], trained on (overlong penalty included)
    accuracy: torch.Tensor  # [num samples], the reward's "acc" extra where it gives one, else its score
    n: int
    # [num samples] bool, partial dynamic filtering: the trajectories trained on (None: all). The others stay for
    # their groups' advantages and are dropped from the batch after them.
    train_mask: torch.Tensor | None = None
    # per sample, a distillation teacher's log-prob of each response token (None: no teacher)
    teacher_logprobs: list[list[float]] | None = None

    @property
    def num_groups(self) -> int:
        return len(self.samples) // self.n

    def select_groups(self, keep: torch.Tensor) -> Scored:
        rows = [i for g in keep.nonzero().flatten().tolist() for i in range(g * self.n, (g + 1) * self.n)]
        return Scored([self.rows[i] for i in rows], [self.samples[i] for i in rows], self.scores[rows],
                      self.accuracy[rows], self.n, None if self.train_mask is None else self.train_mask[rows],
                      None if self.teacher_logprobs is None else [self.teacher_logprobs[i] for i in rows])

    def first_groups(self, count: int) -> Scored:
        return self.select_groups(torch.arange(self.num_groups) < count)

    @staticmethod
    def concat(parts: list[Scored]) -> Scored:
        masks = None if all(p.train_mask is None for p in parts) else torch.cat(
            [p.train_mask if p.train_mask is not None else torch.ones(len(p.samples), dtype=torch.bool) for p in parts])
        teacher = None if parts[0].teacher_logprobs is None else [lp for p in parts for lp in p.teacher_logprobs]
        return Scored([r for p in parts for r in p.rows], [s for p in parts for s in p.samples],
                      torch.cat([p.scores for p in parts]), torch.cat([p.accuracy for p in parts]), parts[0].n, masks,
                      teacher)

    def batch(self, pad_id: int) -> RolloutBatch:
        routes = [s.routed_experts for s in self.samples]  # MoE routing replay: every sample's, or none
        batch = build_batch([s.prompt_ids for s in self.samples], [s.response_ids for s in self.samples],
                            [s.logprobs for s in self.samples], pad_id=pad_id, images=[s.images for s in self.samples],
                            loss_masks=[s.loss_mask for s in self.samples],
                            routed_experts=routes if all(r is not None for r in routes) else None)
        if self.teacher_logprobs is not None:
            batch.teacher_logprobs = torch.zeros_like(batch.rollout_logprobs)
            for row, values in enumerate(self.teacher_logprobs):
                batch.teacher_logprobs[row, :len(values)] = torch.tensor(values, dtype=torch.float32)
        return batch


@dataclass
class _Turn:
    """A step's turn at the prompt stream: it draws once the previous step has drawn its last batch."""

    previous: concurrent.futures.Future  # the previous step's `done`
    start_state: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)  # before its prompts
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)  # its last batch drawn


@dataclass
class StepRollouts:
    """What one step trains on: the scored groups, ReMax baselines (or None), metrics and phase times, and the
    prompt stream's position before its prompts were drawn."""

    scored: Scored
    baselines: torch.Tensor | None
    metrics: dict[str, float]
    timing: dict[str, float]
    data_before: dict = field(default_factory=dict)


class RolloutSampler:
    def __init__(self, settings: SamplerSettings, tokenizer: Any, stream: Any, renderer: Any, rewards: RewardPool,
                 policy: Any, placement: Placement, generate_group: GenerateGroup = dispatch):
        self.settings, self.tokenizer, self.stream, self.renderer = settings, tokenizer, stream, renderer
        self.rewards, self.generate_group = rewards, generate_group
        self.stop_ids = stop_token_ids(tokenizer, settings.rollout.stop_tokens)
        # where the engines run: the placement's; policy: the PolicyGroup, whose export ranks send the weights
        self.fleet = EngineFleet(settings.rollout, settings.model, placement, policy, settings.engine_dir,
                                 settings.num_threads, settings.placement_timeout_s,
                                 routed_experts=settings.moe_routing_replay)
        self.teacher: Teacher | None = None  # on-policy distillation's (distill.*), opened with the engines
        self._batches = iter(stream)
        self._turns: dict[int, _Turn] = {}
        self._last_turn_done = concurrent.futures.Future()
        self._last_turn_done.set_result(None)
        self._scoring = asyncio.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rl360-rollout-sampler", daemon=True)
        self._thread.start()
        try:
            self.run(self.fleet.start())
            if settings.distill.enabled:
                self.teacher = self.run(Teacher.open(settings.distill, settings.model, settings.engine_dir))
        except BaseException:
            self.close()
            raise

    # ---- the trainer's side (any thread but the sampler's) ----
    def generate(self, step: int) -> concurrent.futures.Future:
        """A future of `step`'s StepRollouts; the work runs on the sampler's thread, its prompts drawn after those
        of the steps generate was called for before."""
        turn = _Turn(previous=self._last_turn_done)
        self._last_turn_done = turn.done
        self._turns = {s: t for s, t in self._turns.items() if s >= step - self.settings.rollout.max_staleness - 2}
        self._turns[step] = turn
        return asyncio.run_coroutine_threadsafe(self._generate_step(step, turn), self._loop)

    def sync_weights(self, version: int) -> dict[str, float]:
        """The policy's current weights into every engine as `version` (restarted engines included)."""
        return self.run(self.fleet.sync_weights(version))

    def data_state(self, next_step: int) -> dict:
        """The stream position before `next_step`'s prompts were drawn (after the last step's, when generate
        was not called for `next_step`)."""
        turn = self._turns.get(next_step)
        if turn is not None:
            return turn.start_state.result()
        return self.run(self._state_after(self._last_turn_done))

    async def _state_after(self, done: concurrent.futures.Future) -> dict:
        await asyncio.wrap_future(done)
        return self.stream.state_dict()

    def load_data_state(self, state: dict) -> None:
        self.stream.load_state_dict(state)
        self._batches = iter(self.stream)

    def describe(self) -> list[dict]:
        return self.fleet.describe()

    def score(self, items: list[RewardItem]) -> list[RewardResult]:
        """`items` scored by the run's reward pool on the sampler's thread (between steps' scoring calls)."""
        return self.run(self._score_items(items))[0]

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if self._thread.is_alive():  # a step still generating (a run stopped mid-rollout) ends first
            asyncio.run_coroutine_threadsafe(_cancel_others(), self._loop).result(timeout=2 * CLOSE_TIMEOUT_S)
        self.fleet.close()
        if self.teacher is not None:
            asyncio.run_coroutine_threadsafe(self.teacher.close(), self._loop).result(timeout=CLOSE_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def run(self, coroutine) -> Any:
        """`coroutine` run on the sampler's thread (beside steps still generating), waited for."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def sample(self, rows: list[dict], rollout: Any, seed: int,
                     metrics: dict[str, float] | None = None) -> list[Sample]:
        """`rollout.n` samples of each prompt row (its temperature, top_p, top_k, max_response_length and stop),
        sample j of row i seeded `seed + i * n + j`, `n` consecutive per row: through `generate_group` (the agent
        loop where one is set) on the fleet's engines as they are now. On the sampler's thread (`run`)."""
        params = SamplingParams(n=rollout.n, temperature=rollout.temperature, top_p=rollout.top_p,
                                top_k=rollout.top_k, max_new_tokens=rollout.max_response_length,
                                stop_token_ids=self.stop_ids, stop=list(rollout.stop),
                                routed_experts=self.settings.moe_routing_replay)
        groups = await self.generate_group(self.fleet, [self.renderer.prompt(row) for row in rows], params, seed,
                                           {} if metrics is None else metrics, rows)
        return [sample for group in groups for sample in group]

    def summary(self, sample: Sample) -> TrajectorySummary | None:
        """What the reward reads of a multi-turn trajectory (None for a single response: its text is all)."""
        if sample.turns is None and not hasattr(sample, "trace"):
            return None
        return sample.summary(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))

    # ---- one step ----
    async def _generate_step(self, step: int, turn: _Turn) -> StepRollouts:
        timing: dict[str, float] = {}
        metrics: dict[str, float] = self.fleet.step_metrics()
        scored = await self._collect_groups(step, turn, timing, metrics)
        baselines = None
        if self.settings.algorithm.adv_estimator == "remax":  # ReMax: a greedy response's score per prompt
            baselines = await self._greedy_baselines(scored, timing, metrics)
        samples = scored.samples
        oldest = torch.tensor([sample.weight_version for sample in samples], dtype=torch.float32)
        statuses = [sample.status for sample in samples]
        metrics.update({
            "rollout/staleness_mean": (step - 1 - oldest).mean().item(),  # by each response's oldest token
            "rollout/staleness_max": (step - 1 - oldest).max().item(),
            "rollout/truncated_frac": statuses.count("truncated") / len(statuses),
            "rollout/aborted": sum(sample.resumed > 0 for sample in samples),
            "rollout/resumed": sum(sample.resumed for sample in samples),
            "rollout/mixed_version_frac": sum(sample.token_versions is not None for sample in samples) / len(samples),
            # actor.moe_routing_replay: samples whose engine returned no routes (the step's batch then replays none)
            **({"rollout/routes_missing": sum(sample.routed_experts is None for sample in samples)}
               if self.settings.moe_routing_replay else {}),
            **self.fleet.restart_metrics(),
            # the share of the rollout's time the engines had requests in flight (an agent's tool calls that
            # stalled decoding leave engines idle: the share falls); a timing, so not the same in a rerun
            "timing/engine_busy_frac": timing.pop("engines_busy", 0.0) / max(
                timing.get("rollout", 0.0) * len(self.fleet.engines), 1e-9),
        })
        if self.fleet.placement.colocate:  # the engines' memory goes to training until the next weight update
            metrics["rollout/engines_released"] = await self.fleet.release(["weights", "kv_cache"])
        return StepRollouts(scored, baselines, metrics, timing, turn.start_state.result())

    async def _collect_groups(self, step: int, turn: _Turn, timing: dict[str, float],
                              metrics: dict[str, float]) -> Scored:
        """`data.batch_size` scored prompt groups; the step's sampling metrics go into `metrics`.

        Without dynamic sampling: one prompt batch. With it (DAPO): groups whose scores are all equal are set
        aside and more prompt batches are sampled; after `max_num_gen_batches` the step fills up with set-aside
        groups (no signal under group-centred advantages) and counts them."""
        settings, algo = self.settings, self.settings.algorithm
        if algo.filter_groups and algo.partial_filter:
            return await self._collect_partial(step, turn, timing, metrics)
        kept: list[Scored] = []
        uniform: list[Scored] = []
        sampled: list[torch.Tensor] = []  # every score of the step, trained on or not
        sampled_accuracy: list[torch.Tensor] = []
        gen_batches = filled = 0
        await asyncio.wrap_future(turn.previous)
        skipped_before = self.stream.skipped()
        turn.start_state.set_result(self.stream.state_dict())
        try:
            while sum(g.num_groups for g in kept) < settings.batch_size:
                if gen_batches and algo.max_num_gen_batches and gen_batches >= algo.max_num_gen_batches:
                    filled = settings.batch_size - sum(g.num_groups for g in kept)
                    kept += uniform
                    break
                gen_batches += 1
                rows = next(self._batches)
                if not algo.filter_groups:  # one batch a step: the next step may draw now
                    self._end_turn(turn, skipped_before, metrics)
                scored = await self._rollout_and_score(rows, settings.rollout,
                                                       settings.seed * 1_000_003 + step + 7_919 * (gen_batches - 1),
                                                       timing, metrics)
                sampled.append(scored.scores)
                sampled_accuracy.append(scored.accuracy)
                if algo.filter_groups:
                    metric = scored.accuracy if algo.filter_groups_metric == "acc" else scored.scores
                    varied = varied_groups(metric, settings.rollout.n)
                    kept.append(scored.select_groups(varied))
                    uniform.append(scored.select_groups(~varied))
                else:
                    kept.append(scored)
        finally:
            self._end_turn(turn, skipped_before, metrics)
        metrics.update({"reward/mean_sampled": torch.cat(sampled).mean().item(),
                        # the reward functions' accuracy (`acc`, else the score) before any overlong penalty
                        "reward/accuracy_sampled": torch.cat(sampled_accuracy).mean().item(),
                        "dynamic_sampling/gen_batches": gen_batches, "dynamic_sampling/filled_groups": filled})
        return Scored.concat(kept).first_groups(settings.batch_size)

    async def _collect_partial(self, step: int, turn: _Turn, timing: dict[str, float],
                               metrics: dict[str, float]) -> Scored:
        """PyVision's partial dynamic filtering: prompt batches are sampled until `data.batch_size * rollout.n`
        trajectories are kept, a trajectory kept when its group's scores vary and its ending is one of
        `algorithm.partial_filter_keep` (`partial_keep`). Whole groups are returned, the kept trajectories marked
        (`Scored.train_mask`): the trainer computes advantages over whole groups and trains on the kept ones. Past
        the target, the kept trajectories of the most varied groups are trained on (PyVision's std ranking);
        after `max_num_gen_batches` batches, set-aside trajectories fill the step, in the order sampled, and are
        counted (`dynamic_sampling/filled_trajectories`)."""
        settings, algo = self.settings, self.settings.algorithm
        target, n = settings.batch_size * settings.rollout.n, settings.rollout.n
        endings = set(algo.partial_filter_keep)
        parts: list[Scored] = []
        gen_batches = filled = 0
        await asyncio.wrap_future(turn.previous)
        skipped_before = self.stream.skipped()
        turn.start_state.set_result(self.stream.state_dict())
        try:
            while sum(int(p.train_mask.sum()) for p in parts) < target:
                if gen_batches and algo.max_num_gen_batches and gen_batches >= algo.max_num_gen_batches:
                    break
                gen_batches += 1
                scored = await self._rollout_and_score(next(self._batches), settings.rollout,
                                                       settings.seed * 1_000_003 + step + 7_919 * (gen_batches - 1),
                                                       timing, metrics)
                metric = scored.accuracy if algo.filter_groups_metric == "acc" else scored.scores
                ending_kept = torch.tensor([sample.ended_by in endings for sample in scored.samples])
                scored.train_mask = partial_keep(metric, n, ending_kept)
                parts.append(scored)
        finally:
            self._end_turn(turn, skipped_before, metrics)
        every = Scored.concat(parts)
        keep = every.train_mask
        metric = every.accuracy if algo.filter_groups_metric == "acc" else every.scores
        if int(keep.sum()) < target:  # the batch limit: set-aside trajectories fill the step
            missing = (~keep).nonzero().flatten()[:target - int(keep.sum())]
            filled = len(missing)
            keep = keep.clone()
            keep[missing] = True
        every.train_mask = most_varied(keep, group_std(metric, n), target)
        groups = every.train_mask.view(-1, n).any(dim=-1)  # groups without a kept trajectory are left out
        metrics.update({"reward/mean_sampled": every.scores.mean().item(),
                        "dynamic_sampling/gen_batches": gen_batches, "dynamic_sampling/filled_groups": 0,
                        "dynamic_sampling/filled_trajectories": filled,
                        "dynamic_sampling/trained_trajectories": int(every.train_mask.sum()),
                        "dynamic_sampling/partial_groups": int((every.train_mask.view(-1, n)[groups]
                                                                .sum(dim=-1) < n).sum())})
        return every.select_groups(groups)

    def _end_turn(self, turn: _Turn, skipped_before: dict[str, int], metrics: dict[str, float]) -> None:
        """The step has drawn its last prompt batch: the stream's counts for it, and the next step's turn."""
        if turn.done.done():
            return
        metrics.update({"data/epoch": self.stream.epoch, **_skipped_metrics(self.stream.skipped(), skipped_before)})
        turn.done.set_result(None)

    async def _rollout_and_score(self, rows: list[dict], rollout: Any, seed: int, timing: dict[str, float],
                                 metrics: dict[str, float], with_teacher: bool = True) -> Scored:
        """`rollout.n` responses for each prompt row, scored by its data_source's reward under a timeout (and by
        the distillation teacher, when there is one and `with_teacher`); reward counts are added to `metrics`."""
        started, busy = time.perf_counter(), self.fleet.busy_seconds()
        samples = await self.sample(rows, rollout, seed, metrics)
        _add(timing, "rollout", time.perf_counter() - started)
        _add(timing, "engines_busy", self.fleet.busy_seconds() - busy)
        sample_rows = [row for row in rows for _ in range(rollout.n)]
        started = time.perf_counter()
        texts = self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        items = [RewardItem(row["data_source"], text, row["reward_model"]["ground_truth"], row.get("extra_info"),
                            self.summary(sample))
                 for row, text, sample in zip(sample_rows, texts, samples)]
        results, counts = await self._score_items(items)
        _add(timing, "reward", time.perf_counter() - started)
        scores = torch.tensor([r.score for r in results], dtype=torch.float32)
        accuracy = torch.tensor([float(r.extras.get("acc", r.score)) for r in results], dtype=torch.float32)
        if self.settings.overlong_buffer_len:
            lengths = torch.tensor([len(s.response_ids) for s in samples])
            penalty = overlong_penalty(lengths, rollout.max_response_length, self.settings.overlong_buffer_len,
                                       self.settings.overlong_penalty_factor)
            scores = scores + penalty
            counts["reward/overlong_penalized"] = int((penalty < 0).sum())
        for key, value in counts.items():
            metrics[key] = metrics.get(key, 0) + value
        teacher = None
        if self.teacher is not None and with_teacher:  # distillation: the teacher's log-probs of every sampled token
            started = time.perf_counter()
            teacher = await self.teacher.logprobs(samples)
            _add(timing, "teacher", time.perf_counter() - started)
        return Scored(sample_rows, samples, scores, accuracy, rollout.n, teacher_logprobs=teacher)

    async def _score_items(self, items: list[RewardItem]) -> tuple[list[RewardResult], dict[str, float]]:
        """The pool's results and counts; one scoring call at a time (steps and evaluations may overlap)."""
        async with self._scoring:
            return await asyncio.to_thread(self._score, items)

    def _score(self, items: list[RewardItem]) -> tuple[list, dict[str, float]]:
        return self.rewards.score(items), self.rewards.last_metrics()

    async def _greedy_baselines(self, scored: Scored, timing: dict[str, float],
                                metrics: dict[str, float]) -> torch.Tensor:
        """[num samples] ReMax baselines: each prompt's greedy (temperature 0) response, scored like the samples
        and repeated for the prompt's `n` samples. The greedy responses are not trained on; their reward calls,
        timeouts and errors count in `metrics` with the samples'."""
        greedy_rollout = replace(self.settings.rollout, n=1, temperature=0.0)
        greedy = await self._rollout_and_score(scored.rows[::scored.n], greedy_rollout, 0, timing, metrics,
                                               with_teacher=False)
        metrics["reward/greedy_baseline_mean"] = greedy.scores.mean().item()
        return greedy.scores.repeat_interleave(scored.n)


async def _cancel_others() -> None:
    """Cancel every other task of the running loop and wait (at most CLOSE_TIMEOUT_S) until they have ended."""
    others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in others:
        task.cancel()
    if others:
        await asyncio.wait(others, timeout=CLOSE_TIMEOUT_S)


def _add(timing: dict[str, float], name: str, seconds: float) -> None:
    timing[name] = timing.get(name, 0.0) + seconds


def _skipped_metrics(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """Rows the data stream left out in this step (bad rows under data.on_bad_row=skip; prompts over
    data.max_prompt_length) and since the run began."""
    names = {"bad_rows": "bad_rows", "filtered": "too_long"}
    return {**{f"data/skipped_{names[k]}": now[k] - before[k] for k in names},
            **{f"data/skipped_{names[k]}_total": now[k] for k in names}}


def stop_token_ids(tokenizer: Any, stop_tokens: list[str]) -> list[int]:
    """The ids that end a response: the tokenizer's end-of-turn token and `rollout.stop_tokens` (`ConfigError` for
    one that is not a single token)."""
    ids = {tokenizer.eos_token_id} - {None}
    for token in stop_tokens:
        encoded = tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) != 1:
            raise ConfigError(f"rollout.stop_tokens: {token!r} is {len(encoded)} tokens of the model's tokenizer, not "
                              "one; list single tokens")
        ids.add(encoded[0])
    return sorted(ids)
