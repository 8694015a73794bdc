"""The agent as the training sampler's `generate_group`: every sample of every prompt one trajectory of
`run_agent`, all in flight at once so the engines stay busy, each turn one request on the fleet's least-loaded
engine. Sample j of prompt i is seeded `seed + i * n + j`, as single-turn samples are; the step's agent metrics
(`rl360.agents.metrics`) go into the step's metrics.

    sampler = RolloutSampler(..., generate_group=agent_group(agent, tokenizer))

The fleet is used through its `generate(prompts, params, seed, metrics)` alone, so this room needs nothing of
`rl360.rollout`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from rl360.agents.build import Agent
from rl360.agents.loop import call_stop_ids, run_agent
from rl360.agents.metrics import agent_metrics
from rl360.core.prompt import Prompt
from rl360.core.sampling import SamplingParams
from rl360.core.trajectory import Sample


def agent_group(agent: Agent, tokenizer: Any):
    """A `generate_group(fleet, prompts, params, seed, metrics, rows) -> list[list[Sample]]` running `agent`;
    a turn also ends at a finished tool call (`call_stop_ids`), and each prompt row's
    `extra_info.tools_kwargs.<tool>.create_kwargs` start its trajectories' tools."""
    stop_ids = call_stop_ids(tokenizer, agent.parser)

    async def generate_group(fleet: Any, prompts: list[Prompt], params: SamplingParams, seed: int,
                             metrics: dict[str, float], rows: list[Mapping[str, Any]] | None = None
                             ) -> list[list[Sample]]:
        async def turn(context: Prompt, turn_params: SamplingParams, turn_seed: int) -> Sample:
            return (await fleet.generate([context], replace(turn_params, n=1), turn_seed, metrics))[0][0]

        n = params.n
        params = replace(params, stop_token_ids=sorted({*params.stop_token_ids, *stop_ids}))
        kwargs = [tool_kwargs(row) for row in rows] if rows is not None else [{}] * len(prompts)
        trajectories = await asyncio.gather(*(
            run_agent(turn, prompt, tokenizer, agent.tools, agent.parser, agent.settings, params, seed + i * n + j,
                      kwargs[i])
            for i, prompt in enumerate(prompts) for j in range(n)))
        for name, value in agent_metrics(list(trajectories)).items():
            metrics[name] = value
        return [list(trajectories[i * n:(i + 1) * n]) for i in range(len(prompts))]

    return generate_group


def tool_kwargs(row: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A prompt row's `create_kwargs` by tool name, from verl's `extra_info.tools_kwargs.<tool>.create_kwargs`
    ({} where absent)."""
    extra = row.get("extra_info") or {}
    tools = extra.get("tools_kwargs") or {} if isinstance(extra, Mapping) else {}
    return {name: dict((entry or {}).get("create_kwargs") or {}) for name, entry in tools.items()
            if isinstance(entry, Mapping)}
