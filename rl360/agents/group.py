"""The agent as the training sampler's `generate_group`: every sample of every prompt one trajectory of
`run_agent`, all in flight at once so the engines stay busy. Sample j of prompt i is seeded `seed + i * n + j`,
as single-turn samples are; the step's agent metrics (`rl360.agents.metrics`) go into the step's metrics.

    sampler = RolloutSampler(..., generate_group=agent_group(agent, tokenizer))

Each turn is one request on the fleet's least-loaded engine; with `agent.batch_turns` the trajectories go in
step instead: once every unfinished trajectory waits for its next turn, those turns are one request (`TurnBatch`),
which an engine that decodes a batch at once (the in-process HF engine) runs in the time of one.

The fleet is used through its `generate(prompts, params, seed, metrics, budgets)` alone, so this room needs nothing of
`rl360.rollout`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from rl360.agents.build import Agent
from rl360.agents.loop import check_chat_template, run_agent
from rl360.agents.metrics import agent_metrics
from rl360.agents.tools.base import prepare_tools
from rl360.config import ConfigError
from rl360.core.prompt import Prompt
from rl360.core.sampling import SamplingParams
from rl360.core.trajectory import Sample


def agent_group(agent: Agent, tokenizer: Any):
    """A `generate_group(fleet, prompts, params, seed, metrics, rows) -> list[list[Sample]]` running `agent`;
    each prompt row's `extra_info.tools_kwargs.<tool>.create_kwargs` start its trajectories' tools. `ConfigError`
    when the model's chat template cannot carry the agent's tool replies."""
    try:
        check_chat_template(tokenizer, agent.parser)
    except ValueError as err:
        raise ConfigError(f"agent.parser: the model's chat template does not fit the agent loop: {err}") from None
    prepare_tools(agent.tools, None)  # the tools' processes start beside the engines and the policy

    async def generate_group(fleet: Any, prompts: list[Prompt], params: SamplingParams, seed: int,
                             metrics: dict[str, float], rows: list[Mapping[str, Any]] | None = None
                             ) -> list[list[Sample]]:
        async def turn(context: Prompt, turn_params: SamplingParams, turn_seed: int) -> Sample:
            return (await fleet.generate([context], replace(turn_params, n=1), turn_seed, metrics))[0][0]

        n = params.n
        batch = TurnBatch(fleet, len(prompts) * n, metrics) if agent.settings.batch_turns else None
        kwargs = [tool_kwargs(row) for row in rows] if rows is not None else [{}] * len(prompts)

        async def trajectory(index: int, prompt: Prompt, prompt_kwargs: dict[str, dict[str, Any]]):
            generate = batch.caller(index) if batch is not None else turn
            try:
                return await run_agent(generate, prompt, tokenizer, agent.tools, agent.parser, agent.settings,
                                       params, seed + index, prompt_kwargs)
            finally:
                if batch is not None:
                    batch.finished()

        trajectories = await asyncio.gather(*(trajectory(i * n + j, prompt, kwargs[i])
                                              for i, prompt in enumerate(prompts) for j in range(n)))
        for name, value in agent_metrics(list(trajectories)).items():
            metrics[name] = value
        return [list(trajectories[i * n:(i + 1) * n]) for i in range(len(prompts))]

    return generate_group


class TurnBatch:
    """Turns of `count` trajectories sent together: when every unfinished trajectory waits for a turn, they are
    one `fleet.generate` call, in trajectory order, seeded by the first one's turn seed, with the largest token
    budget among them; a turn that ran past its own budget is cut there (finish "length"), as the engine would
    have cut it, and a turn a weight update aborts (`rollout.partial`) is continued up to its own budget only
    (`budgets`). The requests differ only in their budgets (one run's sampling settings)."""

    def __init__(self, fleet: Any, count: int, metrics: dict[str, float]):
        self.fleet, self.unfinished, self.metrics = fleet, count, metrics
        self.waiting: dict[int, tuple[Prompt, SamplingParams, int, asyncio.Future]] = {}
        self.sending: set[asyncio.Task] = set()  # held here: the event loop keeps only weak references to tasks

    def caller(self, index: int):
        async def generate_turn(context: Prompt, params: SamplingParams, seed: int) -> Sample:
            future = asyncio.get_running_loop().create_future()
            self.waiting[index] = (context, params, seed, future)
            self._send_when_all_wait()
            return await future

        return generate_turn

    def finished(self) -> None:
        self.unfinished -= 1
        self._send_when_all_wait()

    def _send_when_all_wait(self) -> None:
        if self.waiting and len(self.waiting) == self.unfinished:
            requests = [self.waiting[index] for index in sorted(self.waiting)]
            self.waiting = {}
            task = asyncio.get_running_loop().create_task(self._send(requests))
            self.sending.add(task)
            task.add_done_callback(self.sending.discard)

    async def _send(self, requests: list[tuple[Prompt, SamplingParams, int, asyncio.Future]]) -> None:
        budget = max(params.max_new_tokens for _, params, _, _ in requests)
        params = replace(requests[0][1], n=1, max_new_tokens=budget)
        try:
            groups = await self.fleet.generate([context for context, _, _, _ in requests], params, requests[0][2],
                                               self.metrics, budgets=[own.max_new_tokens for _, own, _, _ in requests])
        except BaseException as error:  # every waiting trajectory fails with the request
            for *_, future in requests:
                future.set_exception(error)
            return
        for (_, own, _, future), [sample] in zip(requests, groups, strict=True):
            future.set_result(_cut(sample, own.max_new_tokens))


def _cut(sample: Sample, budget: int) -> Sample:
    """`sample` with at most `budget` response tokens (finish "length" when cut)."""
    if len(sample.response_ids) <= budget:
        return sample
    return replace(sample, response_ids=sample.response_ids[:budget], logprobs=sample.logprobs[:budget],
                   finish_reason="length",
                   token_versions=sample.token_versions[:budget] if sample.token_versions else None)


def tool_kwargs(row: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A prompt row's `create_kwargs` by tool name, from verl's `extra_info.tools_kwargs.<tool>.create_kwargs`
    ({} where absent)."""
    extra = row.get("extra_info") or {}
    tools = extra.get("tools_kwargs") or {} if isinstance(extra, Mapping) else {}
    return {name: dict((entry or {}).get("create_kwargs") or {}) for name, entry in tools.items()
            if isinstance(entry, Mapping)}
