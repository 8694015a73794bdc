"""Habits given to a quickstart's random-weight model before RL, like those an instruct model brings: repeating
what a tool showed it. Each tells nothing about an answer the model has not been shown.

`answer_contexts` runs the real agent loop (its tools, parser and chat template) with a first turn that is a given
tool call, and returns the context of the turn after the tool's reply: exactly what the model sees when it answers
after calling. `prime_answers` then teaches the model, by a short supervised pass over such contexts, to write the
answer there with a chosen probability: a partial habit the RL run has to strengthen, and one it can only use by
calling, since the contexts without a call hold no answer.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch

from rl360.agents.loop import AgentSettings, run_agent
from rl360.agents.parsers import Parser
from rl360.agents.tools import Tool
from rl360.core import Prompt, Sample, prompt_ids


def answer_contexts(prompts: list[Prompt], call_id: int, end_id: int, tokenizer: Any, tools: dict[str, Tool],
                    parser: Parser, settings: AgentSettings) -> list[Prompt]:
    """For each of `prompts` (rendered, with the generation prompt), the context of the turn after a first turn
    that is the one token `call_id` (a whole tool call): the prompt, the call, the tool's reply (its images
    included) and the next assistant header."""

    async def one(prompt: Prompt) -> Prompt:
        seen: list[Prompt] = []

        async def generate_turn(context: Prompt, params: Any, seed: int) -> Sample:
            seen.append(context)
            token = call_id if len(seen) == 1 else end_id
            return Sample(list(prompt_ids(context)), [token], [0.0], "stop")

        await run_agent(generate_turn, prompt, tokenizer, tools, parser, settings)
        if len(seen) != 2:
            raise ValueError(f"answer_contexts: the call token {call_id} did not lead to a tool reply")
        return seen[1]

    async def every() -> list[Prompt]:
        return list(await asyncio.gather(*(one(prompt) for prompt in prompts)))

    return asyncio.run(every())


def final_hidden_state(model_dir: str | Path, contexts: list[Prompt]) -> torch.Tensor:
    """The saved model's final (normed) hidden state at the end of `contexts`, averaged over them."""
    from rl360.engine.hf_engine import HFEngine

    engine = HFEngine(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        batch = engine.prefill(contexts)
        out = engine.model(attention_mask=batch.mask, position_ids=batch.positions, output_hidden_states=True,
                           **batch.first_inputs())
    return out.hidden_states[-1][:, -1].mean(0)


def prime_answers(model_dir: str | Path, contexts: list[Prompt], answer_ids: list[int], accuracy: float,
                  lr: float = 3e-3, max_updates: int = 500, seed: int = 0) -> float:
    """Teach the saved model (text or vision-language), by a short supervised pass (Adam on every weight, the
    whole batch each update), to write `answer_ids[i]` next after `contexts[i]`, stopping once its mean
    probability of the right answer there reaches `accuracy`; returns that mean."""
    from rl360.engine.hf_engine import HFEngine

    torch.manual_seed(seed)
    engine = HFEngine(str(model_dir), dtype=torch.float32)
    model = engine.model
    targets = torch.tensor(answer_ids)

    def last_logits() -> torch.Tensor:
        batch = engine.prefill(contexts)
        out = model(attention_mask=batch.mask, position_ids=batch.positions, **batch.first_inputs())
        return out.logits[:, -1].float()

    def right_probability() -> float:
        with torch.no_grad():
            return float(last_logits().softmax(-1).gather(1, targets[:, None]).mean())

    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    reached = right_probability()
    for _ in range(max_updates):
        if reached >= accuracy:
            break
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(last_logits(), targets).backward()
        optimizer.step()
        reached = right_probability()
    model.save_pretrained(str(model_dir))
    return reached
