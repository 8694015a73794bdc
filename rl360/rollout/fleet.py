"""The engine fleet: the rollout engines of a run, started, kept healthy and sent work, all behind `Engine`.

    fleet = EngineFleet(cfg.rollout, cfg.model, placement, policy, log_dir, num_threads, placement_timeout_s)
    await fleet.start()
    groups = await fleet.generate(prompts, params, seed, metrics)   # on the least-loaded usable engines
    await fleet.sync_weights(version)        # the policy's weights into every engine
    await fleet.release(["weights", "kv_cache"])                    # colocate: memory to training
    fleet.describe(); fleet.close()

Its coroutines run on one event loop (the sampler's thread). `generate` splits the prompts over the usable
engines in contiguous parts, least-loaded first; sample j of prompt i is seeded `seed + i * n + j` whichever
engine draws it (each part's seed is offset by its first prompt's position), so the samples do not depend on
the number of engines or on which engine drew them. An engine that fails a request (connection refused or
reset, no reply within `rollout.request_timeout_s`, a 5xx, aborted samples) is restarted in the background and
its part is sent to another usable engine; with none left, the fleet waits for the restart and syncs the
current weights into it. A restarted engine takes part again once a weight update has reached it. More than
`rollout.max_engine_restarts` restarts in a run end it.

A weight update stops new generate requests until the engines serve the new weights. Requests in flight either
finish under the weights they started with (the update waits for them) or, with `rollout.partial`, are aborted
by the engines' `pause` and continued after the update from the tokens they had (prompt + tokens so far, the
remaining token budget), their tokens tagged with the version that drew each (`Sample.token_versions`). A
continued sample still ends at its first stop string (`SamplingParams.stop`), one that spans the cut included,
which the engine that continued it never saw whole: it is cut there as an engine would have cut it
(`rl360.engine.stop_strings.cut_at_stop`, with the model's tokenizer).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
import torch

from rl360.cluster.placement import Placement
from rl360.core import Prompt, Sample, SamplingParams
from rl360.core.engine_kinds import engine_kind
from rl360.engine.stop_strings import cut_at_stop
from rl360.rollout.engines import (
    ActorEngine,
    Engine,
    EngineDown,
    EnginesDown,
    ProcessEngine,
    WeightSyncArgs,
    engine_command,
    new_api_key,
)
from rl360.rollout.router import SGLangRouter


class EngineFleet:
    def __init__(self, rollout: Any, model: Any, placement: Placement, policy: Any, log_dir: Path,
                 num_threads: int = 0, placement_timeout_s: float = 600.0, engines: list[Engine] | None = None,
                 routed_experts: bool = False, config_section: str = "rollout"):
        """`engines`: ones built elsewhere (any `Engine`), started by `start` instead of those `rollout` names.
        `routed_experts`: SGLang engines are started able to return a mixture of experts' routes.
        `config_section`: the config section `rollout`'s values come from, named in its lines and errors (`rl360
        eval`: eval, whose lines then say "eval engine 0 failed ...")."""
        self.config_section = config_section
        self.rollout, self.model, self.placement, self.policy = rollout, model, placement, policy
        self.routed_experts = routed_experts
        self.log_dir = Path(log_dir)
        self.num_threads, self.placement_timeout_s = num_threads, placement_timeout_s
        self.api_key = new_api_key()
        self.engines: list[Engine] = list(engines or [])
        self.version = 0  # the weights every usable engine serves
        self.restarts_total = 0
        self._restarts_reported = 0  # restarts_total at the last step's metrics
        self._restarting: dict[int, asyncio.Task] = {}
        self._load: dict[int, int] = {}  # prompts in flight at each engine
        self._busy_since: dict[int, float] = {}  # when each engine with work in flight last had none
        self._busy_s = 0.0  # seconds engines have had work in flight, added over the engines (ended spans)
        self.in_flight = 0  # generate requests out at engines
        self._drained: asyncio.Event | None = None  # set while none is
        self._weights_ready: asyncio.Event | None = None  # cleared while a weight update runs: new requests wait
        self._pauses = 0  # weight updates that paused generation (rollout.partial)
        self._sync_lock: asyncio.Lock | None = None
        self._tokenizer: Any = None  # the model's, for stop strings over continued samples (loaded when needed)
        self.router: SGLangRouter | None = None  # rollout.router=sglang: generate requests go through it

    # ---- start, describe, close ----
    async def start(self) -> None:
        """Build the engines (`rollout.engine`) where the placement puts them and wait until they serve."""
        self._drained, self._weights_ready, self._sync_lock = asyncio.Event(), asyncio.Event(), asyncio.Lock()
        self._drained.set()
        self._weights_ready.set()
        self.engines = self.engines or self._build()
        await asyncio.gather(*(engine.start() for engine in self.engines))
        for engine in self.engines:
            engine.usable = True
        if self.rollout.router == "sglang":
            self.router = SGLangRouter(self.rollout.router_policy, self.api_key, self.log_dir / "router.log",
                                       self.rollout.request_timeout_s)
            await self.router.start()
            await self._route_usable()
        self._write_engine_list()

    def _build(self) -> list[Engine]:
        rollout, kind, model, use_gpu = self.rollout, self.rollout.engine, self.model, self.placement.use_gpu
        if engine_kind(kind).in_process:
            from rl360.actor.policy_model import DTYPES
            from rl360.cluster import WorkerGroup
            from rl360.engine.hf_engine import HFEngine

            # colocated on GPUs: on policy rank 0's bundle (its GPU), half of it each
            shared = self.policy.workers.placement_group if self.placement.gpu_share < 1 else None
            group = WorkerGroup(HFEngine, 1, model.path, DTYPES[model.dtype], use_gpu=use_gpu, name="rollout",
                                distributed=False, share=self.placement.gpu_share, shared_group=shared,
                                timeout_s=self.placement_timeout_s, num_threads=self.num_threads,
                                min_pixels=model.min_pixels or None, max_pixels=model.max_pixels or None)
            return [ActorEngine(group.actors[0], group=group)]
        # the engines decode their shares of a step at the same time: trainer.num_threads is split between them
        per_engine = max(1, self.num_threads // rollout.num_engines)
        pixel_args = [f"--{flag}={value}" for flag, value in (("min-pixels", model.min_pixels),
                                                             ("max-pixels", model.max_pixels)) if value]
        threads = {"OMP_NUM_THREADS": str(per_engine)} if self.num_threads else {}
        routes_flag = engine_kind(kind).routes_flag
        routes_args = [routes_flag] if self.routed_experts and routes_flag else []
        return [
            ProcessEngine(i, engine_command(kind, model.path, model.dtype,
                                            rollout.engine_tensor_parallel, rollout.mem_fraction,
                                            [*pixel_args, *routes_args, *rollout.engine_args]),
                          self.log_dir, self.api_key, rollout.startup_timeout_s, rollout.request_timeout_s,
                          env={**threads, **self._local_gpus(i)}, kind=kind, hosts=rollout.engine_hosts,
                          num_gpus=rollout.engine_tensor_parallel if use_gpu else 0)
            for i in range(rollout.num_engines)
        ]

    def _local_gpus(self, index: int) -> dict[str, str]:
        """Engine `index`'s GPUs on the trainer's node (engine_hosts=local), as the placement puts them."""
        if not self.placement.use_gpu or self.rollout.engine_hosts != "local":
            return {}  # engine_hosts=ray: Ray gives each engine actor its own devices
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # Slurm's list, when it set one
        devices = visible.split(",") if visible else [str(d) for d in range(_node_gpus())]
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.placement.engine_devices(index, devices))}

    def describe(self) -> list[dict]:
        return [engine.describe() for engine in self.engines]

    def _write_engine_list(self) -> None:
        if not any(engine.url for engine in self.engines):
            return  # nothing to list: no engine process
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / "engines.json"
        path.with_suffix(".tmp").write_text(json.dumps(self.describe(), indent=1))
        path.with_suffix(".tmp").replace(path)

    def close(self) -> None:
        """Stop the router and every engine (synchronous: callable from any thread once the loop no longer runs
        them); `engines.json` keeps the last state, a restart still under way counted."""
        if self.router is not None:
            self.router.stop()
        for engine in self.engines:
            engine.stop()
        self._write_engine_list()

    # ---- metrics ----
    def step_metrics(self) -> dict[str, float]:
        """A step's engine counters before its generate calls: prompts per engine (several engines, without a
        router: the router picks the engine)."""
        if len(self.engines) > 1 and self.router is None:
            return {f"rollout/engine{engine.index}_prompts": 0 for engine in self.engines}
        return {}

    def busy_seconds(self) -> float:
        """Seconds the engines have had requests in flight so far, added over the engines (an engine decoding
        for 2 s counts 2 s; two decoding at once for 2 s, 4 s)."""
        now = time.monotonic()
        return self._busy_s + sum(now - since for since in self._busy_since.values())

    def restart_metrics(self) -> dict[str, float]:
        """Restarts since the previous call (a restart during a weight update shows in the next step) and in all."""
        since, self._restarts_reported = self.restarts_total - self._restarts_reported, self.restarts_total
        return {"rollout/engine_restarts": since, "rollout/engine_restarts_total": self.restarts_total}

    # ---- health and restarts ----
    def engine_down(self, engine: Engine, error: Exception) -> None:
        """Take `engine` out of service and restart it in the background (once per failure)."""
        if engine.index in self._restarting:
            return
        engine.usable = False
        self.restarts_total += 1
        print(f"{self.config_section} engine {engine.index} failed ({str(error) or type(error).__name__}); "
              f"restarting it ({self.restarts_total} restart(s) in this run)", flush=True)
        if self.restarts_total > self.rollout.max_engine_restarts:
            raise RuntimeError(f"{self.config_section} engines were restarted {self.restarts_total} times, more than "
                               f"{self.config_section}.max_engine_restarts={self.rollout.max_engine_restarts}; "
                               f"last failure: {error}; see {engine.log_path}") from error
        self._restarting[engine.index] = asyncio.get_running_loop().create_task(self._restart(engine))

    async def _restart(self, engine: Engine) -> None:
        try:
            if self.router is not None:  # before the restart, which gives the engine a new address
                await self.router.remove(engine.url)
            await engine.restart()
            engine.usable = self.version == 0  # otherwise at the next weight update
            await self._route_usable()
            self._write_engine_list()
        finally:
            self._restarting.pop(engine.index, None)

    async def _restarts_done(self) -> None:
        while self._restarting:
            await asyncio.gather(*self._restarting.values(), return_exceptions=True)

    async def _usable_engine(self) -> Engine:
        """The usable engine with the least work in flight; with none, a restarted one given the current weights."""
        while True:
            usable = [engine for engine in self.engines if engine.usable]
            if usable:
                return min(usable, key=lambda engine: self._load.get(engine.index, 0))
            if not self._restarting:
                raise RuntimeError(f"no {self.config_section} engine is usable and none is restarting")
            await self._restarts_done()
            await self._sync(self.version, only_if_none_usable=True)

    async def _route_usable(self) -> None:
        """Every usable engine (it serves the current weights) into the router, the others out of it."""
        if self.router is None:
            return
        for engine in self.engines:
            if engine.usable:
                await self.router.add(engine.url)

    async def _failed(self, engine: Engine, error: EngineDown) -> None:
        """A generate request to `engine` failed (no answer, a 5xx, aborted samples). Through the router the
        engine that failed is not known: the engines whose process is gone are restarted, and a failure with none
        gone (and none restarting) is the router's own and stops the run."""
        if self.router is None:
            self.engine_down(engine, error)
            return
        alive = await asyncio.gather(*(candidate.alive() for candidate in self.engines))
        dead = [candidate for candidate, running in zip(self.engines, alive) if not running]
        if not dead and not self._restarting:
            raise RuntimeError(f"{error}; every engine process is running: see {self.router.log_path}") from error
        for candidate in dead:
            self.engine_down(candidate, error)

    async def _each(self, call: str, engines: list[Engine], *args) -> list[Engine]:
        """`call` on each of `engines`; those that did (a true or None answer), restarting the ones found gone.
        Any other failure is raised once every engine has answered."""
        failures: list[BaseException] = []

        async def one(engine: Engine) -> bool:
            try:
                return await getattr(engine, call)(*args) is not False
            except EngineDown as err:
                self.engine_down(engine, err)
            except Exception as err:  # raised below, once the others have answered
                failures.append(err)
            return False

        answered = await asyncio.gather(*(one(engine) for engine in engines))
        if failures:
            raise failures[0]
        return [engine for engine, did in zip(engines, answered) if did]

    # ---- memory (rollout.colocate) ----
    async def release(self, tags: list[str]) -> int:
        """Free `tags` of every engine that holds them for training; how many engines did."""
        return len(await self._each("release", self.engines, tags))

    async def resume(self, tags: list[str]) -> int:
        return len(await self._each("resume", self.engines, tags))

    # ---- weights ----
    async def sync_weights(self, version: int) -> dict[str, float]:
        return await self._sync(version)

    async def _sync(self, version: int, only_if_none_usable: bool = False) -> dict[str, float]:
        """Every engine onto `version`: new generate requests wait meanwhile; requests in flight end first, or
        (rollout.partial) are aborted, to be continued under the new weights."""
        async with self._sync_lock:
            if only_if_none_usable and any(engine.usable for engine in self.engines):
                return {}
            started = time.perf_counter()
            self._weights_ready.clear()
            try:
                if self.rollout.partial:
                    self._pauses += 1
                    paused = await self._each("pause", [engine for engine in self.engines if engine.supports_pause])
                else:
                    await self._drained.wait()
                metrics = {"timing/rollout_drain_s": time.perf_counter() - started}
                await self.resume(["weights"])  # colocated: back from training, weights first
                metrics.update(await self._send_weights(version))
                await self.resume(["kv_cache"])
                self.version = version
                for engine in self.engines:
                    engine.version, engine.usable = version, True
                await self._route_usable()
                if self.rollout.partial:
                    await self._each("resume_generation", paused)
            finally:
                self._weights_ready.set()
            return metrics

    async def _send_weights(self, version: int) -> dict[str, float]:
        """One send through the first engine's `sync_weights` to all of them; engines that died on the way are
        restarted (up to rollout.max_engine_restarts) and the send tried again."""
        args = WeightSyncArgs(self.placement.weight_sync, self.api_key, self.log_dir / "weights")
        for attempt in range(self.rollout.max_engine_restarts + 1):
            await self._restarts_done()  # engines found dead on the way are back, with a new address
            try:
                return await self.engines[0].sync_weights(self.policy, version, self.engines, args)
            except EnginesDown as down:
                if attempt == self.rollout.max_engine_restarts:
                    raise down.cause from down
                for engine in down.engines:
                    self.engine_down(engine, down.cause)
        raise AssertionError("unreachable")

    # ---- dispatch ----
    async def generate(self, prompts: list[Prompt], params: SamplingParams, seed: int,
                       metrics: dict[str, float] | None = None, budgets: list[int] | None = None
                       ) -> list[list[Sample]]:
        """`params.n` samples per prompt over the usable engines, sample j of prompt i seeded `seed + i * n + j`;
        a failed part goes to another engine, aborted samples are continued. Prompts per engine go into
        `metrics` (with several engines). `budgets`: each prompt's own token budget (at most
        `params.max_new_tokens`, which the engines draw up to), for callers that cut each sample there (the agent's
        batched turns): an aborted sample is continued only up to its own budget, none once it has reached it."""
        usable = [engine for engine in self.engines if engine.usable] or [await self._usable_engine()]
        usable = sorted(usable, key=lambda engine: self._load.get(engine.index, 0))[:max(1, len(prompts))]
        bounds = [len(prompts) * i // len(usable) for i in range(len(usable) + 1)]
        budgets = budgets or [params.max_new_tokens] * len(prompts)
        parts = await asyncio.gather(*(self._part(prompts[a:b], params, seed + a * params.n, engine, metrics,
                                                  budgets[a:b])
                                       for a, b, engine in zip(bounds, bounds[1:], usable) if b > a))
        return [group for part in parts for group in part]

    async def _part(self, prompts: list[Prompt], params: SamplingParams, seed: int, engine: Engine,
                    metrics: dict[str, float] | None, budgets: list[int]) -> list[list[Sample]]:
        while True:
            try:
                groups, paused = await self._request(engine, prompts, params, seed)
                break
            except EngineDown as err:
                await self._failed(engine, err)
                engine = await self._usable_engine()
        if metrics is not None and len(self.engines) > 1 and self.router is None:
            key = f"rollout/engine{engine.index}_prompts"
            metrics[key] = metrics.get(key, 0) + len(prompts)
        if not paused and any(sample.finish_reason == "abort" for group in groups for sample in group):
            await self._failed(engine, EngineDown(f"engine {engine.index} ({engine.url}) aborted requests"))
        return [list(await asyncio.gather(*(self._continue(sample, replace(params, max_new_tokens=budget),
                                                           seed + i * params.n + j)
                                            for j, sample in enumerate(group))))
                for i, (group, budget) in enumerate(zip(groups, budgets, strict=True))]

    async def _continue(self, sample: Sample, params: SamplingParams, seed: int) -> Sample:
        """An aborted sample (cut by a weight update, or by an engine that failed) continued from the tokens it
        has, with the token budget it has left, until it stops or reaches the length limit (or its first stop
        string, one spanning a cut included)."""
        cut = sample.finish_reason == "abort"
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
                await self._failed(engine, err)
                continue
            if more.finish_reason == "abort" and not paused:
                await self._failed(engine, EngineDown(f"engine {engine.index} ({engine.url}) aborted a request"))
            sample = sample.continued(more)
        if cut and params.stop:
            sample = cut_at_stop(sample, self.tokenizer(), params.stop)
        return sample

    def tokenizer(self) -> Any:
        """The model's tokenizer, loaded once."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model.path)
        return self._tokenizer

    async def _request(self, engine: Engine, prompts: list[Prompt], params: SamplingParams,
                       seed: int) -> tuple[list[list[Sample]], bool]:
        """One generate request, sent when no weight update is running; returns the samples and whether a
        weight update paused generation while it was out (which explains aborted samples)."""
        await self._weights_ready.wait()
        pauses = self._pauses
        self.in_flight += 1
        self._drained.clear()
        if not self._load.get(engine.index):
            self._busy_since[engine.index] = time.monotonic()
        self._load[engine.index] = self._load.get(engine.index, 0) + len(prompts)
        try:
            groups = await (self.router or engine).generate(prompts, params, seed)
        finally:
            self._load[engine.index] -= len(prompts)
            if not self._load[engine.index]:
                self._busy_s += time.monotonic() - self._busy_since.pop(engine.index)
            self.in_flight -= 1
            if not self.in_flight:
                self._drained.set()
        return groups, self._pauses != pauses


def _node_gpus() -> int:
    """GPUs of the trainer's node: what CUDA sees, else what Ray declares there (a CPU machine placed as if it
    had GPUs)."""
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    here = ray.util.get_node_ip_address()
    return int(next((node["Resources"].get("GPU", 0) for node in ray.nodes()
                     if node.get("Alive") and node["NodeManagerAddress"] == here), 0))
