"""The rollout manager: a step's scored prompt groups from the prompt stream, the engines and the reward pool.

    manager = RolloutManager(cfg, tokenizer, rewards, policy)   # starts the engines
    future = manager.generate(step)      # a concurrent.futures.Future of StepRollouts, computed meanwhile
    manager.sync_weights(step)           # the policy's weights into every engine, version `step`
    manager.data_state(next_step)        # the stream position before `next_step`'s prompts (for checkpoints)
    manager.close()

It lives in the trainer's process on an event-loop thread of its own (engine requests are asyncio), so
`generate` runs while the trainer trains: async training is `generate(step + k)` issued before step's update
(k <= rollout.max_staleness). Several steps may generate at once; they take turns at the prompt stream in the
order `generate` was called (a step with dynamic sampling keeps its turn until its last batch is drawn), so the
data order does not depend on timing. The stream, the reward pool and the tokenizer are used by that thread only.

A weight update stops new generate requests until the engines serve the new weights. Requests in flight either
finish under the weights they started with (the update waits for them) or, with `rollout.partial`, are aborted
by `/pause_generation` and continued after the update from the tokens they had (prompt + tokens so far, the
remaining token budget), their tokens tagged with the version that drew each (`Sample.token_versions`); the
engine log-prob of every token is kept, so rollout correction (`actor.rollout_correction`) sees the policy that
really sampled it. Counted: `rollout/aborted` (samples cut by an update, or by an engine) and `rollout/resumed`.

Prompts of a step are split over the usable engines in contiguous parts (sample j of prompt i is seeded
`seed + i * n + j` on server engines, so the samples do not depend on the number of engines or on which engine
drew them). An engine that fails a request (connection refused or reset, no reply within
`rollout.request_timeout_s`, a 5xx, aborted samples) is restarted in the background and its part is sent to
another usable engine; with none left, the manager waits for the restart and syncs the current weights into
it. Samples are scored once, after every part has come back. A restarted engine takes part again once a weight
update has reached it. Counted: `rollout/engine_restarts` (since the previous step's metrics: a restart during
a weight update shows in the next step) and `rollout/engine_restarts_total`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import ray
import torch

from rl360.actor.batch import RolloutBatch, build_batch
from rl360.algos.dynamic_sampling import overlong_penalty, varied_groups
from rl360.cluster.placement import Placement, make_placement
from rl360.core import Prompt, Sample, SamplingParams
from rl360.core.client import EngineTimeout
from rl360.rewards import RewardItem, RewardPool
from rl360.rollout.engines import ActorEngine, EngineDown, ProcessEngine, engine_command, new_api_key


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
                           [s.logprobs for s in self.samples], pad_id=pad_id, images=[s.images for s in self.samples],
                           loss_masks=[s.loss_mask for s in self.samples])


@dataclass
class _Turn:
    """A step's turn at the prompt stream: it draws once the previous step has drawn its last batch."""

    previous: concurrent.futures.Future  # the previous step's `done`
    start_state: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)  # before its prompts
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)  # its last batch drawn


@dataclass
class StepRollouts:
    """What one step trains on: the scored groups, ReMax baselines (or None), metrics and phase times."""

    scored: Scored
    baselines: torch.Tensor | None
    metrics: dict[str, float]
    timing: dict[str, float]


class RolloutManager:
    def __init__(self, cfg: Any, tokenizer: Any, stream: Any, renderer: Any, rewards: RewardPool, policy: Any,
                 placement: Placement | None = None):
        self.cfg, self.tokenizer, self.stream, self.renderer, self.rewards = cfg, tokenizer, stream, renderer, rewards
        self.policy = policy  # PolicyGroup: its export ranks send the weights
        # where the engines run (on CPU when none is given)
        self.placement = placement or make_placement(cfg.actor.parallel.ranks, cfg.algorithm.adv_estimator == "gae",
                                                     cfg.rollout, gpus=0)
        self.version = 0  # the weights every usable engine serves
        self.restarts_total = 0
        self._restarts_reported = 0  # restarts_total at the last step's metrics
        self._load: dict[int, int] = {}  # prompts in flight at each engine
        self._batches = iter(stream)
        self._turns: dict[int, _Turn] = {}
        self._last_turn_done = concurrent.futures.Future()
        self._last_turn_done.set_result(None)
        self._in_flight = 0  # generate requests out at engines
        self._drained = asyncio.Event()  # set while none is
        self._drained.set()
        self._weights_ready = asyncio.Event()  # cleared while a weight update runs: new requests wait
        self._weights_ready.set()
        self._pauses = 0  # weight updates that paused generation (rollout.partial)
        self._sync_lock = asyncio.Lock()
        self._scoring = asyncio.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rl360-rollout-manager", daemon=True)
        self._thread.start()
        self.log_dir = Path(cfg.output_dir) / "rollout"
        self.api_key = new_api_key()
        self.engines: list = []
        self._restarting: dict[int, asyncio.Task] = {}
        try:
            self._call(self._start_engines())
        except BaseException:
            self.close()
            raise

    # ---- the trainer's side (any thread but the manager's) ----
    def generate(self, step: int) -> concurrent.futures.Future:
        """A future of `step`'s StepRollouts; the work runs on the manager's thread, its prompts drawn after those
        of the steps generate was called for before."""
        turn = _Turn(previous=self._last_turn_done)
        self._last_turn_done = turn.done
        self._turns = {s: t for s, t in self._turns.items() if s >= step - self.cfg.rollout.max_staleness - 2}
        self._turns[step] = turn
        return asyncio.run_coroutine_threadsafe(self._generate_step(step, turn), self._loop)

    def sync_weights(self, version: int) -> dict[str, float]:
        """The policy's current weights into every engine as `version` (restarted engines included)."""
        return self._call(self._sync(version))

    def data_state(self, next_step: int) -> dict:
        """The stream position before `next_step`'s prompts were drawn (after the last step's, when generate
        was not called for `next_step`)."""
        turn = self._turns.get(next_step)
        if turn is not None:
            return turn.start_state.result()
        return self._call(self._state_after(self._last_turn_done))

    async def _state_after(self, done: concurrent.futures.Future) -> dict:
        await asyncio.wrap_future(done)
        return self.stream.state_dict()

    def load_data_state(self, state: dict) -> None:
        self.stream.load_state_dict(state)
        self._batches = iter(self.stream)

    def describe(self) -> list[dict]:
        return [engine.describe() for engine in self.engines]

    def close(self) -> None:
        if self._loop.is_closed():
            return
        for engine in self.engines:
            if isinstance(engine, ProcessEngine):
                engine.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def _call(self, coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    # ---- engines ----
    async def _start_engines(self) -> None:
        rollout, kind, placement = self.cfg.rollout, self.cfg.rollout.engine, self.placement
        use_gpu = placement.use_gpu
        if kind == "hf":
            from rl360.actor.policy import DTYPES
            from rl360.cluster import WorkerGroup
            from rl360.engine.hf_engine import HFEngine

            # colocated on GPUs: on policy rank 0's bundle (its GPU), half of it each
            shared = self.policy.workers.placement_group if placement.gpu_share < 1 else None
            group = WorkerGroup(HFEngine, 1, self.cfg.model.path, DTYPES[self.cfg.model.dtype], use_gpu=use_gpu,
                                name="rollout", distributed=False, share=placement.gpu_share, shared_group=shared,
                                timeout_s=self.cfg.cluster.placement_timeout_s,
                                num_threads=self.cfg.trainer.num_threads, min_pixels=self.cfg.model.min_pixels or None,
                                max_pixels=self.cfg.model.max_pixels or None)
            self.engines = [ActorEngine(group.actors[0])]
            return
        # the engines decode their shares of a step at the same time: trainer.num_threads is split between them
        per_engine = max(1, self.cfg.trainer.num_threads // rollout.num_engines)
        pixel_args = [f"--{flag}={value}" for flag, value in (("min-pixels", self.cfg.model.min_pixels),
                                                             ("max-pixels", self.cfg.model.max_pixels)) if value]
        threads = {"OMP_NUM_THREADS": str(per_engine)} if self.cfg.trainer.num_threads else {}
        self.engines = [
            ProcessEngine(i, engine_command(kind, self.cfg.model.path, self.cfg.model.dtype, self.api_key,
                                            rollout.engine_tensor_parallel, rollout.mem_fraction,
                                            [*pixel_args, *rollout.engine_args]),
                          self.log_dir, self.api_key, rollout.startup_timeout_s, rollout.request_timeout_s,
                          env={**threads, **self._local_gpus(i)}, kind=kind, hosts=rollout.engine_hosts,
                          num_gpus=rollout.engine_tensor_parallel if use_gpu else 0)
            for i in range(rollout.num_engines)
        ]
        await asyncio.gather(*(engine.start() for engine in self.engines))
        for engine in self.engines:
            engine.usable = True
        self._write_engine_list()

    def _local_gpus(self, index: int) -> dict[str, str]:
        """Engine `index`'s GPUs on the trainer's node (engine_hosts=local), as the placement puts them."""
        if not self.placement.use_gpu or self.cfg.rollout.engine_hosts != "local":
            return {}  # engine_hosts=ray: Ray gives each engine actor its own devices
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # Slurm's list, when it set one
        devices = visible.split(",") if visible else [str(d) for d in range(self._node_gpus())]
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.placement.engine_devices(index, devices))}

    def _node_gpus(self) -> int:
        """GPUs of the trainer's node: what CUDA sees, else what Ray declares there (a CPU machine placed as if
        it had GPUs)."""
        if torch.cuda.is_available():
            return torch.cuda.device_count()
        here = ray.util.get_node_ip_address()
        return int(next((node["Resources"].get("GPU", 0) for node in ray.nodes()
                         if node.get("Alive") and node["NodeManagerAddress"] == here), 0))

    def _write_engine_list(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / "engines.json"
        path.with_suffix(".tmp").write_text(json.dumps(self.describe(), indent=1))
        path.with_suffix(".tmp").replace(path)

    def _engine_down(self, engine: ProcessEngine, error: Exception) -> None:
        """Take `engine` out of service and restart it in the background (once per failure)."""
        if engine.index in self._restarting:
            return
        engine.usable = False
        self.restarts_total += 1
        print(f"rollout engine {engine.index} failed ({str(error) or type(error).__name__}); restarting it "
              f"({self.restarts_total} restart(s) in this run)", flush=True)
        if self.restarts_total > self.cfg.rollout.max_engine_restarts:
            raise RuntimeError(f"rollout engines were restarted {self.restarts_total} times, more than "
                               f"rollout.max_engine_restarts={self.cfg.rollout.max_engine_restarts}; last failure: "
                               f"{error}; see {engine.log_path}") from error
        self._restarting[engine.index] = asyncio.get_running_loop().create_task(self._restart(engine))

    async def _restart(self, engine: ProcessEngine) -> None:
        try:
            await engine.restart()
            engine.usable = self.version == 0  # otherwise at the next weight update
            self._write_engine_list()
        finally:
            self._restarting.pop(engine.index, None)

    async def _usable_engine(self):
        """The usable engine with the least work in flight; with none, a restarted one given the current weights."""
        while True:
            usable = [engine for engine in self.engines if engine.usable]
            if usable:
                return min(usable, key=lambda engine: self._load.get(engine.index, 0))
            if not self._restarting:
                raise RuntimeError("no rollout engine is usable and none is restarting")
            await self._restarts_done()
            await self._sync(self.version, only_if_none_usable=True)

    # ---- weights ----
    async def _sync(self, version: int, only_if_none_usable: bool = False) -> dict[str, float]:
        """Every engine onto `version`: new generate requests wait meanwhile; requests in flight end first, or
        (rollout.partial) are aborted, to be continued under the new weights."""
        async with self._sync_lock:
            if only_if_none_usable and any(engine.usable for engine in self.engines):
                return {}
            started = time.perf_counter()
            self._weights_ready.clear()
            try:
                if self.cfg.rollout.partial:
                    self._pauses += 1
                    paused = await self._each_engine("pause_generation", "abort")
                else:
                    await self._drained.wait()
                metrics = {"timing/rollout_drain_s": time.perf_counter() - started}
                if isinstance(self.engines[0], ActorEngine):
                    await self._sync_actor(self.engines[0], version)
                else:
                    await self._memory("resume", ["weights"])  # colocated: back from training, weights first
                    await self._restarts_done()  # engines found dead on the way are back, with a new address
                    metrics.update(await self._sync_processes(version))
                    await self._memory("resume", ["kv_cache"])
                self.version = version
                for engine in self.engines:
                    engine.version, engine.usable = version, True
                if self.cfg.rollout.partial:
                    await self._each_engine("continue_generation", engines=paused)
            finally:
                self._weights_ready.set()
            return metrics

    async def _each_engine(self, call: str, *args, engines: list | None = None) -> list:
        """`call` on every usable process engine (or on `engines`); returns those that answered, restarting the
        others."""
        engines = [engine for engine in (self.engines if engines is None else engines)
                   if isinstance(engine, ProcessEngine) and engine.client is not None and engine.usable]
        outcomes = await asyncio.gather(*(getattr(engine.client, call)(*args) for engine in engines),
                                        return_exceptions=True)
        answered = []
        for engine, outcome in zip(engines, outcomes):
            if isinstance(outcome, (httpx.TransportError, EngineTimeout, OSError)):
                self._engine_down(engine, outcome)
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                answered.append(engine)
        return answered

    async def _restarts_done(self) -> None:
        while self._restarting:
            await asyncio.gather(*self._restarting.values(), return_exceptions=True)

    async def _sync_actor(self, engine: ActorEngine, version: int) -> None:
        pending = []
        async for bucket_ref in self.policy.export_weights():
            pending.append(engine.actor.update_weights.remote(bucket_ref, version))
        await asyncio.gather(*pending)
        await engine.actor.finish_weight_update.remote(version)

    async def _sync_processes(self, version: int) -> dict[str, float]:
        scratch = self.log_dir / "weights"  # disk: the checkpoint engines load; tensor: a place beside /dev/shm
        scratch.mkdir(parents=True, exist_ok=True)
        for attempt in range(self.cfg.rollout.max_engine_restarts + 1):
            urls = [engine.url for engine in self.engines]
            try:
                return await self.policy.send_weights(urls, self.cfg.rollout.weight_sync, version, self.api_key,
                                                      str(scratch))
            except ray.exceptions.RayTaskError as err:
                alive = await asyncio.gather(*(engine.alive() for engine in self.engines))
                dead = [engine for engine, running in zip(self.engines, alive) if not running]
                if not dead or attempt == self.cfg.rollout.max_engine_restarts:
                    raise
                for engine in dead:
                    self._engine_down(engine, err)
                await self._restarts_done()
        raise AssertionError("unreachable")

    # ---- one step ----
    async def _generate_step(self, step: int, turn: _Turn) -> StepRollouts:
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        if len(self.engines) > 1:
            metrics.update({f"rollout/engine{engine.index}_prompts": 0 for engine in self.engines})
        scored = await self._collect_groups(step, turn, timing, metrics)
        baselines = None
        if self.cfg.algorithm.adv_estimator == "remax":  # ReMax: a greedy response's score per prompt
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
            "rollout/engine_restarts": self.restarts_total - self._restarts_reported,
            "rollout/engine_restarts_total": self.restarts_total,
        })
        self._restarts_reported = self.restarts_total
        if self.cfg.rollout.colocate:  # the engines' memory goes to training until the next weight update
            metrics["rollout/engines_released"] = await self._memory("release", ["weights", "kv_cache"])
        return StepRollouts(scored, baselines, metrics, timing)

    async def _memory(self, action: str, tags: list[str]) -> int:
        """Release or resume `tags` of every usable process engine (a restarted engine holds nothing released);
        returns how many engines did."""
        engines = [engine for engine in self.engines
                   if isinstance(engine, ProcessEngine) and engine.client is not None
                   and (action == "release") != bool(set(tags) & engine.released)]
        call = "release_memory_occupation" if action == "release" else "resume_memory_occupation"
        outcomes = await asyncio.gather(*(getattr(engine.client, call)(tags) for engine in engines),
                                        return_exceptions=True)
        for engine, outcome in zip(engines, outcomes):
            if isinstance(outcome, (httpx.TransportError, EngineTimeout, OSError)):  # died: restarted, holds all
                self._engine_down(engine, outcome)
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                engine.released = engine.released | set(tags) if action == "release" else engine.released - set(tags)
        return sum(not isinstance(outcome, BaseException) for outcome in outcomes)

    async def _collect_groups(self, step: int, turn: _Turn, timing: dict[str, float],
                              metrics: dict[str, float]) -> Scored:
        """`data.batch_size` scored prompt groups; the step's sampling metrics go into `metrics`.

        Without dynamic sampling: one prompt batch. With it (DAPO): groups whose scores are all equal are set
        aside and more prompt batches are sampled; after `max_num_gen_batches` the step fills up with set-aside
        groups (no signal under group-centred advantages) and counts them."""
        cfg, algo = self.cfg, self.cfg.algorithm
        kept: list[Scored] = []
        uniform: list[Scored] = []
        sampled: list[torch.Tensor] = []  # every score of the step, trained on or not
        gen_batches = filled = 0
        await asyncio.wrap_future(turn.previous)
        skipped_before = self.stream.skipped()
        turn.start_state.set_result(self.stream.state_dict())
        try:
            while sum(g.num_groups for g in kept) < cfg.data.batch_size:
                if gen_batches and algo.max_num_gen_batches and gen_batches >= algo.max_num_gen_batches:
                    filled = cfg.data.batch_size - sum(g.num_groups for g in kept)
                    kept += uniform
                    break
                gen_batches += 1
                rows = next(self._batches)
                if not algo.filter_groups:  # one batch a step: the next step may draw now
                    self._end_turn(turn, skipped_before, metrics)
                scored = await self._rollout_and_score(rows, cfg.rollout,
                                                       cfg.seed * 1_000_003 + step + 7_919 * (gen_batches - 1),
                                                       timing, metrics)
                sampled.append(scored.scores)
                if algo.filter_groups:
                    metric = scored.accuracy if algo.filter_groups_metric == "acc" else scored.scores
                    varied = varied_groups(metric, cfg.rollout.n)
                    kept.append(scored.select_groups(varied))
                    uniform.append(scored.select_groups(~varied))
                else:
                    kept.append(scored)
        finally:
            self._end_turn(turn, skipped_before, metrics)
        metrics.update({"reward/mean_sampled": torch.cat(sampled).mean().item(),
                        "dynamic_sampling/gen_batches": gen_batches, "dynamic_sampling/filled_groups": filled})
        return Scored.concat(kept).first_groups(cfg.data.batch_size)

    def _end_turn(self, turn: _Turn, skipped_before: dict[str, int], metrics: dict[str, float]) -> None:
        """The step has drawn its last prompt batch: the stream's counts for it, and the next step's turn."""
        if turn.done.done():
            return
        metrics.update({"data/epoch": self.stream.epoch, **_skipped_metrics(self.stream.skipped(), skipped_before)})
        turn.done.set_result(None)

    async def _rollout_and_score(self, rows: list[dict], rollout: Any, seed: int, timing: dict[str, float],
                                 metrics: dict[str, float]) -> Scored:
        """`rollout.n` responses for each prompt row, scored by its data_source's reward under a timeout;
        reward counts are added to `metrics`."""
        n = rollout.n
        started = time.perf_counter()
        params = SamplingParams(n=n, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                                max_new_tokens=rollout.max_response_length,
                                stop_token_ids=sorted({self.tokenizer.eos_token_id} - {None}))
        groups = await self._sample([self.renderer.prompt(row) for row in rows], params, seed, metrics)
        _add(timing, "rollout", time.perf_counter() - started)
        samples = [sample for group in groups for sample in group]
        sample_rows = [row for row in rows for _ in range(n)]
        started = time.perf_counter()
        texts = self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        items = [RewardItem(row["data_source"], text, row["reward_model"]["ground_truth"], row.get("extra_info"))
                 for row, text in zip(sample_rows, texts)]
        async with self._scoring:  # the pool scores one call at a time (steps may overlap)
            results, counts = await asyncio.to_thread(self._score, items)
        _add(timing, "reward", time.perf_counter() - started)
        scores = torch.tensor([r.score for r in results], dtype=torch.float32)
        accuracy = torch.tensor([float(r.extras.get("acc", r.score)) for r in results], dtype=torch.float32)
        if self.cfg.reward.overlong_buffer_len:
            lengths = torch.tensor([len(s.response_ids) for s in samples])
            penalty = overlong_penalty(lengths, rollout.max_response_length, self.cfg.reward.overlong_buffer_len,
                                       self.cfg.reward.overlong_penalty_factor)
            scores = scores + penalty
            counts["reward/overlong_penalized"] = int((penalty < 0).sum())
        for key, value in counts.items():
            metrics[key] = metrics.get(key, 0) + value
        return Scored(sample_rows, samples, scores, accuracy, n)

    def _score(self, items: list[RewardItem]) -> tuple[list, dict[str, float]]:
        return self.rewards.score(items), self.rewards.last_metrics()

    async def _greedy_baselines(self, scored: Scored, timing: dict[str, float],
                                metrics: dict[str, float]) -> torch.Tensor:
        """[num samples] ReMax baselines: each prompt's greedy (temperature 0) response, scored like the samples
        and repeated for the prompt's `n` samples. The greedy responses are not trained on; their reward calls,
        timeouts and errors count in `metrics` with the samples'."""
        greedy = await self._rollout_and_score(scored.rows[::scored.n], replace(self.cfg.rollout, n=1, temperature=0.0),
                                               0, timing, metrics)
        metrics["reward/greedy_baseline_mean"] = greedy.scores.mean().item()
        return greedy.scores.repeat_interleave(scored.n)

    async def _sample(self, prompts: list[Prompt], params: SamplingParams, seed: int,
                      metrics: dict[str, float]) -> list[list[Sample]]:
        """`params.n` samples per prompt over the usable engines; a failed part goes to another engine."""
        usable = [engine for engine in self.engines if engine.usable] or [await self._usable_engine()]
        bounds = [len(prompts) * i // len(usable) for i in range(len(usable) + 1)]
        parts = await asyncio.gather(*(self._sample_part(prompts[a:b], params, seed + a * params.n, engine, metrics)
                                       for a, b, engine in zip(bounds, bounds[1:], usable) if b > a))
        return [group for part in parts for group in part]

    async def _sample_part(self, prompts: list[Prompt], params: SamplingParams, seed: int, engine,
                           metrics: dict[str, float]) -> list[list[Sample]]:
        """Sample j of prompt i is seeded `seed + i * n + j`; aborted samples are continued (`_resume`)."""
        while True:
            try:
                groups, paused = await self._request(engine, prompts, params, seed)
                break
            except EngineDown as err:
                self._engine_down(engine, err)
                engine = await self._usable_engine()
        if len(self.engines) > 1:
            metrics[f"rollout/engine{engine.index}_prompts"] += len(prompts)
        if not paused and any(sample.finish_reason == "abort" for group in groups for sample in group):
            self._engine_down(engine, EngineDown(f"engine {engine.index} ({engine.url}) aborted requests"))
        return [list(await asyncio.gather(*(self._resume(sample, params, seed + i * params.n + j)
                                            for j, sample in enumerate(group))))
                for i, group in enumerate(groups)]

    async def _resume(self, sample: Sample, params: SamplingParams, seed: int) -> Sample:
        """An aborted sample (cut by a weight update, or by an engine that failed) continued from the tokens it
        has, with the token budget it has left, until it stops or reaches the length limit."""
        while sample.finish_reason == "abort":
            left = params.max_new_tokens - len(sample.response_ids)
            if left <= 0:
                return replace(sample, finish_reason="length")
            engine = await self._usable_engine()
            try:
                [[more]], paused = await self._request(engine, [sample.continuation()],
                                                       replace(params, n=1, max_new_tokens=left),
                                                       seed + 104_729 * (sample.resumed + 1))
            except EngineDown as err:
                self._engine_down(engine, err)
                continue
            if more.finish_reason == "abort" and not paused:
                self._engine_down(engine, EngineDown(f"engine {engine.index} ({engine.url}) aborted a request"))
            sample = sample.continued(more)
        return sample

    async def _request(self, engine, prompts: list[Prompt], params: SamplingParams,
                       seed: int) -> tuple[list[list[Sample]], bool]:
        """One generate request, sent when no weight update is running; returns the samples and whether a
        weight update paused generation while it was out (which explains aborted samples)."""
        await self._weights_ready.wait()
        pauses = self._pauses
        self._in_flight += 1
        self._drained.clear()
        self._load[engine.index] = self._load.get(engine.index, 0) + len(prompts)
        try:
            groups = await engine.generate(prompts, params, seed)
        finally:
            self._load[engine.index] -= len(prompts)
            self._in_flight -= 1
            if not self._in_flight:
                self._drained.set()
        return groups, self._pauses != pauses


def _add(timing: dict[str, float], name: str, seconds: float) -> None:
    timing[name] = timing.get(name, 0.0) + seconds


def _skipped_metrics(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """Rows the data stream left out in this step (bad rows under data.on_bad_row=skip; prompts over
    data.max_prompt_length) and since the run began."""
    names = {"bad_rows": "bad_rows", "filtered": "too_long"}
    return {**{f"data/skipped_{names[k]}": now[k] - before[k] for k in names},
            **{f"data/skipped_{names[k]}_total": now[k] for k in names}}
