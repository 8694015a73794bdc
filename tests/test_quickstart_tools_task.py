"""The tools quickstart's task holds its premise: the whole call is one token that ends the turn, the python tool
prints the answer token for the row's numbers, the built model calls first in about `CALL_PRIOR` of its replies
(whatever the numbers) and, after the tool's reply, hardly more than the unprimed model does; after the reply
it repeats the printed answer about `COPY_PRIOR` of the time."""

import asyncio
from statistics import mean

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from rl360.agents.build import agent_from_config
from rl360.agents.group import tool_kwargs
from rl360.agents.loop import call_end_ids
from rl360.agents.tools import TrajectoryState
from rl360.config import load_config
from rl360.quickstart.assets import next_token_probabilities
from rl360.quickstart.prepare import prepare_quickstart
from rl360.quickstart.tools_assets import (
    CALL,
    CALL_PRIOR,
    COPY_PRIOR,
    answer_turns,
    build_tools_quickstart_model,
    first_turns,
)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools_task")
    cfg = load_config("configs/quickstart_tools.yaml", [f"model.path={root / 'model'}",
                                                       f"data.train_files=[{root / 'data' / 'train.parquet'}]"])
    prepare_quickstart(cfg, "tools")
    rows = pq.read_table(cfg.data.train_files[0]).slice(0, 24).to_pylist()
    return cfg, rows, root


def test_the_call_is_one_token_that_ends_the_turn_and_the_tool_prints_the_answer_token(task, capsys):
    cfg, rows, _ = task
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    agent = agent_from_config(cfg)
    assert "agent.tools" not in capsys.readouterr().out  # a text model's run says nothing of the tool's image modules
    [call_id] = tokenizer.encode(CALL, add_special_tokens=False)
    assert call_end_ids(tokenizer, agent.parser) == [call_id]
    row = rows[0]
    [call] = agent.parser(CALL).calls
    state = TrajectoryState(kwargs=tool_kwargs(row))
    reply = asyncio.run(agent.tools["python"].call(call.arguments, state))
    truth = row["reward_model"]["ground_truth"]
    assert reply.text.strip() == f"\\boxed{{{truth}}}" and not reply.error
    assert len(tokenizer.encode(reply.text.strip(), add_special_tokens=False)) == 1
    assert "\\boxed" not in CALL  # the reward cannot read an answer in the call itself


def test_the_model_calls_first_about_half_the_time_and_not_again_after_the_reply(task, tmp_path):
    cfg, rows, _ = task
    prompts = [row["prompt"][0]["content"] for row in rows]
    answers = [row["reward_model"]["ground_truth"] for row in rows]
    first = next_token_probabilities(cfg.model.path, CALL, first_turns(prompts))
    after = next_token_probabilities(cfg.model.path, CALL, answer_turns(prompts, answers))
    assert abs(mean(first) - CALL_PRIOR) < 0.2, first
    unprimed = build_tools_quickstart_model(tmp_path / "unprimed", prompts, answers, seed=cfg.seed, call_prior=0)
    before = next_token_probabilities(unprimed, CALL, answer_turns(prompts, answers))
    assert mean(after) < 0.05 and mean(after) < mean(before) + 0.02, (after, before)


def test_after_the_reply_the_model_repeats_the_printed_answer_about_as_primed(task):
    """The copy habit: on rows it was not primed on, the right answer after the reply about `COPY_PRIOR`, and an
    altered reply followed as much (it copies the reply, it does not compute); before any call, chance (1/6)."""
    cfg, rows, _ = task
    prompts = [row["prompt"][0]["content"] for row in rows]
    answers = [row["reward_model"]["ground_truth"] for row in rows]
    altered = [str(int(a) % 6 + 1) for a in answers]

    def repeated(shown: list[str]) -> float:
        return mean(next_token_probabilities(cfg.model.path, f"\\boxed{{{a}}}", answer_turns([p], [a]))[0]
                    for p, a in zip(prompts, shown, strict=True))

    assert abs(repeated(answers) - COPY_PRIOR) < 0.15 and abs(repeated(altered) - COPY_PRIOR) < 0.15
    guessed = mean(next_token_probabilities(cfg.model.path, f"\\boxed{{{a}}}", first_turns([p]))[0]
                   for p, a in zip(prompts, answers, strict=True))
    assert guessed < 0.25, guessed
