"""A weight update that meets generate requests in flight (rollout.mode=async), through the rollout sampler and a
real `rl360 serve rollout` engine process.

With `rollout.partial=true` the update aborts the requests, and the sampler continues every cut response from the
tokens it had under the new weights: each token is tagged with the version that drew it, and the engine log-prob
kept for it is the one of that version's policy (checked against both models' own log-probs). Without it the update
waits for the requests, which end under the weights they started with.

The same holds for agent trajectories (`agent.loop=tools`): a turn the update cuts goes on under the new weights
from the trajectory's context and the turn's tokens so far, and the trajectory then goes on with its tools.

The weights come from a Hugging Face model through `WeightSender` (shared memory), standing in for the Megatron
policy group, whose own sends are tested in tests/test_weight_sync.py and tests/test_rollout_manager.py.
"""

import asyncio
import copy
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl360.agents.build import agent_from_config
from rl360.agents.group import agent_group
from rl360.agents.loop import tool_tokens
from rl360.agents.parsers import ParseResult, ToolCall
from rl360.agents.tools import ToolReply
from rl360.cluster.placement import make_placement
from rl360.config import load_config
from rl360.data import PromptRenderer, PromptStream
from rl360.quickstart.assets import build_quickstart_model
from rl360.rewards.pool import open_reward_pool
from rl360.rollout.sampler import RolloutSampler, SamplerSettings
from rl360.serve.loadgen import metric_total
from rl360.weight_sync.sender import WeightSender

pytestmark = pytest.mark.slow
MAX_TOKENS = 200  # long enough that responses are still being drawn when the update comes


class HFPolicy:
    """What the fleet asks of the policy group for engine processes: `send_weights`."""

    def __init__(self, model):
        self.model, self.sender = model, None

    async def send_weights(self, urls, strategy, version, api_key, scratch_dir):
        if self.sender is None:
            self.sender = WeightSender(urls, strategy, api_key=api_key, scratch_dir=scratch_dir)
        return await asyncio.to_thread(self.sender.send, [list(self.model.state_dict().items())], version)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("partial")
    model = build_quickstart_model(root / "model")
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{a}+{b}"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(a + b)}, "extra_info": {"index": a * 10 + b}}
            for a in range(5) for b in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
    return root, model


def _sampler_inputs(cfg, model_dir):
    """What a RolloutSampler over the run's data needs (tokenizer, renderer, prompt stream, reward pool), and the
    model as it is (version 0) and moved by a fixed random step (version 1, the weights the update sends)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    renderer = PromptRenderer(tokenizer, cfg.data.max_prompt_length)
    stream = PromptStream(cfg.data.train_files, cfg.data.batch_size, seed=0, filter_fn=renderer.fits)
    old = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    new = copy.deepcopy(old)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for parameter in new.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    rewards = open_reward_pool(cfg.reward, announce=lambda line: None)
    return tokenizer, renderer, stream, old, new, rewards


def _sampler(cfg, tokenizer, stream, renderer, rewards, policy, **kwargs) -> RolloutSampler:
    """A RolloutSampler of the run's settings, its engines on CPU."""
    placement = make_placement(cfg.actor.parallel.ranks, cfg.algorithm.uses_critic, cfg.rollout, gpus=0)
    return RolloutSampler(SamplerSettings.of(cfg), tokenizer, stream, renderer, rewards, policy, placement, **kwargs)


def _decoding(fleet) -> bool:
    """Whether an engine server of the fleet is decoding responses now (its `requests_running` gauge)."""
    return any(metric_total(engine.url, "rl360_rollout_requests_running",
                            {"Authorization": f"Bearer {engine.api_key}"}) > 0 for engine in fleet.engines)


def _update_during_generation(assets, name: str, partial: bool):
    """Step 1's rollouts with version 1 of the weights sent while they are drawn; the old and new models."""
    root, model_dir = assets
    cfg = load_config("configs/quickstart.yaml", [
        f"output_dir={root / name}", f"model.path={model_dir}", f"data.train_files=[{root / 'train.parquet'}]",
        "data.batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4", f"rollout.max_response_length={MAX_TOKENS}",
        "rollout.engine=server",
        "rollout.mode=async", f"rollout.partial={str(partial).lower()}", "rollout.weight_sync=tensor",
        "trainer.num_threads=1", "reward.num_workers=1"])
    tokenizer, renderer, stream, old, new, rewards = _sampler_inputs(cfg, model_dir)
    sampler = _sampler(cfg, tokenizer, stream, renderer, rewards, HFPolicy(new))
    try:
        future = sampler.generate(1)
        deadline = time.monotonic() + 60
        while not _decoding(sampler.fleet) and time.monotonic() < deadline:  # past the batch window, in the batch
            time.sleep(0.005)
        time.sleep(0.05)  # the engine is drawing tokens
        assert not future.done(), "step 1's rollouts ended before the update came"
        sync_metrics = sampler.sync_weights(1)
        result = future.result(timeout=300)
    finally:
        sampler.close()
        rewards.close()
    return result, sync_metrics, old, new


@pytest.fixture(scope="module")
def partial_run(assets):
    return _update_during_generation(assets, "partial", partial=True)


def _token_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_cut_responses_go_on_under_the_new_weights_each_token_tagged(partial_run):
    result, _, old, new = partial_run
    samples, metrics = result.scored.samples, result.metrics
    assert len(samples) == 32 and metrics["reward/calls"] == 32  # each response scored once, continued or not
    mixed = [sample for sample in samples if sample.token_versions is not None]
    print(f"{len(mixed)} of 32 responses were cut by the update and continued")
    assert mixed, "no response was cut by the update"
    assert metrics["rollout/aborted"] >= len(mixed) and metrics["rollout/resumed"] >= len(mixed)
    assert metrics["rollout/mixed_version_frac"] == len(mixed) / 32
    for sample in samples:
        versions = sample.versions()
        assert len(versions) == len(sample.response_ids) == len(sample.logprobs) <= MAX_TOKENS
        assert versions == sorted(versions) and set(versions) <= {0, 1}  # old tokens first, then new ones
        assert sample.weight_version == (versions[0] if versions else sample.weight_version)
        assert sample.finish_reason in ("stop", "length")
        if sample.resumed == 0:
            assert sample.token_versions is None
    for sample in mixed:  # every token's log-prob is the one of the weights that drew it
        cut = sample.token_versions.index(1)
        engine = torch.tensor(sample.logprobs)
        before = _token_logprobs(old, sample.prompt_ids, sample.response_ids)
        after = _token_logprobs(new, sample.prompt_ids, sample.response_ids)
        assert torch.allclose(engine[:cut], before[:cut], atol=1e-4), sample
        assert torch.allclose(engine[cut:], after[cut:], atol=1e-4), sample
        assert not torch.allclose(before[cut:], after[cut:], atol=1e-3)  # the two versions do differ there
    assert metrics["rollout/staleness_max"] == 0  # step 1 trains on responses begun under version 0


def test_without_partial_the_update_waits_for_requests_in_flight(assets):
    result, sync_metrics, old, _ = _update_during_generation(assets, "whole", partial=False)
    samples, metrics = result.scored.samples, result.metrics
    assert len(samples) == 32 and metrics["reward/calls"] == 32
    assert metrics["rollout/aborted"] == metrics["rollout/resumed"] == 0
    assert all(sample.token_versions is None and sample.weight_version == 0 for sample in samples)
    assert sync_metrics["timing/rollout_drain_s"] > 0
    for sample in samples[:4]:  # drawn by the old weights from start to end
        engine = torch.tensor(sample.logprobs)
        assert torch.allclose(engine, _token_logprobs(old, sample.prompt_ids, sample.response_ids), atol=1e-4)


def test_steps_take_turns_at_the_prompt_stream(assets):
    """Steps generated at once draw their prompts in the order generate was called, and a checkpoint's data
    position for a step is the stream's position before that step's prompts."""
    root, model_dir = assets
    cfg = load_config("configs/quickstart.yaml", [
        f"output_dir={root / 'turns'}", f"model.path={model_dir}", f"data.train_files=[{root / 'train.parquet'}]",
        "data.batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "rollout.max_response_length=4",
        "rollout.engine=server",
        "rollout.num_engines=2", "rollout.mode=async", "rollout.max_staleness=3", "trainer.num_threads=1",
        "reward.num_workers=1"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    renderer = PromptRenderer(tokenizer, cfg.data.max_prompt_length)
    expected = PromptStream(cfg.data.train_files, 4, seed=0, filter_fn=renderer.fits)
    batches = iter(expected)
    expected_rows, expected_states = [], []
    for _ in range(4):
        expected_states.append(expected.state_dict())
        expected_rows.append([row["extra_info"]["index"] for row in next(batches)])
    expected_states.append(expected.state_dict())  # after the fourth step's prompts
    stream = PromptStream(cfg.data.train_files, 4, seed=0, filter_fn=renderer.fits)
    rewards = open_reward_pool(cfg.reward, announce=lambda line: None)
    sampler = _sampler(cfg, tokenizer, stream, renderer, rewards, None)
    try:
        states = {}
        futures = [sampler.generate(step) for step in range(1, 5)]  # four steps at once
        reader = threading.Thread(target=lambda: states.update({s: sampler.data_state(s) for s in range(1, 5)}))
        reader.start()
        results = [future.result(timeout=300) for future in futures]
        reader.join(timeout=300)
        after = sampler.data_state(5)
    finally:
        sampler.close()
        rewards.close()
    for step, result in enumerate(results):
        rows = [row["extra_info"]["index"] for row in result.scored.rows[::2]]
        assert rows == expected_rows[step], step
        assert states[step + 1] == expected_states[step]
    assert after == expected_states[4]


# ---------------------------------------------------------------- agent trajectories

AGENT_TOKENS = 200  # response tokens of a trajectory (the quickstart model has 256 positions)


class NoteTool:
    """A user tool (`agent.tools` names it by path): it answers each call with its row's `base` (the row's
    create_kwargs), the call's number in its trajectory (kept in the trajectory's state) and the length of the
    turn's text it was handed, so a trajectory's tool replies show what the tool saw."""

    name = "note"
    schema = {"type": "function", "function": {"name": "note", "parameters": {"type": "object", "properties": {}}}}

    def __init__(self, settings):
        self.calls = 0

    async def call(self, arguments, state):
        self.calls += 1
        state.store["note"] = count = state.store.get("note", 0) + 1
        return ToolReply(note_reply(state.kwargs["note"]["base"], count, arguments["text"]))


def note_reply(base: int, count: int, text: str) -> str:
    return f"{base}+{count}={len(text)}"  # characters the quickstart tokenizer has


def parse_every_turn(text: str) -> ParseResult:
    """The tool-call parser of these trajectories: every finished turn is one call of `note` with its whole text."""
    return ParseResult((ToolCall("note", {"text": text}),), "")


@pytest.fixture(scope="module")
def agent_run(assets):
    """Step 1's agent trajectories (8 prompts x 4, up to 4 turns, every finished turn calling `note`), with
    version 1 of the weights sent while their second turns are being drawn. The turns go in step
    (`agent.batch_turns`: one request a round, which the engine decodes as one batch), so once the tool has been
    called and a request is out again, every turn in flight follows a tool call."""
    root, model_dir = assets
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{a}+{a + 1}"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(2 * a + 1)},
             "extra_info": {"index": a, "tools_kwargs": {"note": {"create_kwargs": {"base": 10 + a}}}}}
            for a in range(8)]
    pq.write_table(pa.Table.from_pylist(rows), root / "agent.parquet")
    cfg = load_config("configs/quickstart.yaml", [
        f"output_dir={root / 'agent'}", f"model.path={model_dir}", f"data.train_files=[{root / 'agent.parquet'}]",
        "data.batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4",
        f"rollout.max_response_length={AGENT_TOKENS}", "rollout.engine=server", "rollout.mode=async",
        "rollout.partial=true", "rollout.weight_sync=tensor", "trainer.num_threads=1", "reward.num_workers=1",
        "agent.loop=tools", f"agent.tools=['{__name__}:NoteTool']", f"agent.parser='{__name__}:parse_every_turn'",
        "agent.max_turns=4", "agent.batch_turns=true"])
    agent = agent_from_config(cfg)
    tokenizer, renderer, stream, old, new, rewards = _sampler_inputs(cfg, model_dir)
    sampler = _sampler(cfg, tokenizer, stream, renderer, rewards, HFPolicy(new),
                       generate_group=agent_group(agent, tokenizer))
    note = agent.tools["note"]
    try:
        started = time.monotonic()
        future = sampler.generate(1)
        while note.calls == 0 and time.monotonic() < started + 60:  # the first round of turns has come back
            time.sleep(0.002)
        first_round = time.monotonic() - started
        while sampler.fleet.in_flight == 0 and time.monotonic() < started + 60:  # the second round is out
            time.sleep(0.002)
        # the engine is drawing the second turns: a quarter of the first round's time (up to 200 tokens) in
        time.sleep(first_round / 4)
        assert not future.done(), "step 1's trajectories ended before the update came"
        sampler.sync_weights(1)
        result = future.result(timeout=300)
    finally:
        sampler.close()
        rewards.close()
    return result, old, new, tokenizer


@pytest.fixture
def one_thread():
    """torch on one thread: the tiny model's 64 forwards here take seconds, not milliseconds, when two threads
    contend for a busy machine's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_cut_agent_turns_go_on_under_the_new_weights_and_the_trajectories_go_on(agent_run, one_thread):
    result, old, new, tokenizer = agent_run
    samples, rows, metrics = result.scored.samples, result.scored.rows, result.metrics
    assert len(samples) == 32 and metrics["reward/calls"] == 32  # each trajectory scored once
    batch = result.scored.batch(tokenizer.pad_token_id)
    cut = 0
    differ = []
    for index, (sample, row) in enumerate(zip(samples, rows, strict=True)):
        trace, spans = sample.trace, sample.turn_list()
        assert trace.ended_by in ("done", "max_turns", "budget", "length"), trace
        generated = [span for span in spans if span.generated]
        inserted = [span for span in spans if not span.generated]
        # the spans tile the response; a cut turn is one turn, as long as the trace says
        assert spans[0].start == 0 and spans[-1].end == len(sample.response_ids) <= AGENT_TOKENS
        assert all(a.end == b.start for a, b in zip(spans, spans[1:]))
        assert len(generated) == len(trace.turns) and len(inserted) == len(trace.turns) - 1  # no reply ends it
        assert [span.end - span.start for span in generated] == [turn.generated_tokens for turn in trace.turns]
        assert sample.resumed == sum(turn.resumed for turn in trace.turns)
        versions, mask = sample.versions(), sample.mask()
        assert len(versions) == len(mask) == len(sample.logprobs) == len(sample.response_ids)
        assert batch.response_mask[index, :len(mask)].tolist() == mask  # tool tokens get no loss
        for k, (span, turn) in enumerate(zip(generated, trace.turns)):
            assert mask[span.start:span.end] == [1] * (span.end - span.start)
            own = versions[span.start:span.end]
            assert own == sorted(own) and set(own) <= {0, 1}  # old tokens, then new ones
            if turn.resumed:  # cut once (one update) after a tool call: old tokens, then new ones
                assert turn.resumed == 1 and k > 0 and own[0] == 0 and own[-1] == 1, (k, turn, own)
                cut += 1
            else:
                assert len(set(own)) == 1, (turn, own)
            if k < len(inserted):  # the reply to the whole turn's text, the tool's state and kwargs kept
                text = tokenizer.decode(sample.response_ids[span.start:span.end], skip_special_tokens=False)
                reply = {"role": "tool", "name": "note", "content": note_reply(10 + row["extra_info"]["index"], k + 1,
                                                                               text)}
                tool = inserted[k]
                assert sample.response_ids[tool.start:tool.end] == tool_tokens(tokenizer, text, [reply])
                assert mask[tool.start:tool.end] == [0] * (tool.end - tool.start)
                assert sample.logprobs[tool.start:tool.end] == [0.0] * (tool.end - tool.start)
        # every generated token's engine log-prob is the one of the weights that drew it, in the trajectory's
        # whole context: nothing of the turn or the context was lost or repeated on the way to the engine
        drawn = torch.tensor(mask, dtype=torch.bool)
        newer = torch.tensor(versions) == 1
        before = _token_logprobs(old, sample.prompt_ids, sample.response_ids)
        after = _token_logprobs(new, sample.prompt_ids, sample.response_ids)
        expected = torch.where(newer, after, before)
        assert torch.allclose(torch.tensor(sample.logprobs)[drawn], expected[drawn], atol=1e-4), sample
        differ.append((before - after)[drawn & newer].abs())
    print(f"{cut} turns cut by the update and continued in {metrics['rollout/aborted']} of 32 trajectories")
    assert cut > 0
    assert metrics["agent/cut_turns"] == cut
    assert metrics["rollout/aborted"] == sum(sample.resumed > 0 for sample in samples)
    assert metrics["rollout/resumed"] == sum(sample.resumed for sample in samples) == cut
    assert torch.cat(differ).max() > 1e-3  # the two versions do differ where the new one drew
