"""Trajectories with images added by a tool, through the real agent loop, the HF engine and the Megatron policy on a
tiny Qwen2.5-VL: the trainer's log-probs of every generated token, before and after the zoomed image, are the
engine's (M-RoPE positions over the whole trajectory, every image's pixels at its place), the zoomed image is
what the second turn sees, and the tool's tokens (its image's included) get no gradient.

The tokenizer writes the whole `image_zoom_in` call as one token, so the random model calls the tool often;
the trajectories used are those of the first seeds whose first turn called it."""

import asyncio
import io

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from rl360.actor.batch import build_batch
from rl360.actor.policy import PolicyWorker
from rl360.actor.settings import PolicySettings
from rl360.agents import AgentSettings, run_agent
from rl360.agents.parsers import parse_hermes
from rl360.agents.tools import ToolSettings, get_tool
from rl360.config import load_config
from rl360.core import ImagePrompt, SamplingParams
from rl360.data.images import VisionProcessor
from rl360.engine.hf_engine import HFEngine
from rl360.quickstart.vision_assets import MAX_PIXELS, MIN_PIXELS, build_vision_quickstart_model

QUESTION = "What colour is the mark?"
CALL = '<tool_call>{"name": "image_zoom_in", "arguments": {"bbox_2d": [0, 0, 56, 56]}}</tool_call>'
TEMPERATURE = 0.9


def _png(width, height, colour):
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    texts = [QUESTION, "tool", "Zoomed in on the image to the region [0, 0, 56, 56]."]
    return str(build_vision_quickstart_model(tmp_path_factory.mktemp("agent_vl") / "model", texts=texts, seed=3,
                                             added_tokens=[CALL]))


@pytest.fixture(scope="module")
def trajectories(vl_dir):
    """Three trajectories that zoomed in (two turns, the crop in between) and one that did not."""
    tokenizer = AutoTokenizer.from_pretrained(vl_dir)
    processor = VisionProcessor.from_pretrained(vl_dir)
    picture = _png(112, 84, (200, 30, 30))
    prompt = ImagePrompt(processor.render([{"role": "user", "content": f"<image>{QUESTION}"}], [picture]), (picture,))
    engine = HFEngine(vl_dir)

    async def generate_turn(context, params, seed):
        params.seed = seed
        return (await asyncio.to_thread(engine.generate, [context], params))[0][0]

    tools = {"image_zoom_in": get_tool("image_zoom_in", ToolSettings(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS))}
    settings = AgentSettings(max_turns=2, max_response_length=120, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    params = SamplingParams(temperature=TEMPERATURE, stop_token_ids=[tokenizer.eos_token_id])
    zoomed, plain = [], []
    for seed in range(40):
        sample = asyncio.run(run_agent(generate_turn, prompt, tokenizer, tools, parse_hermes, settings, params, seed))
        if len(sample.trace.turns) == 2 and len(sample.images) == 2 and len(zoomed) < 3:
            zoomed.append(sample)
        elif len(sample.trace.turns) == 1 and not plain:
            plain.append(sample)
        if len(zoomed) == 3 and plain:
            return zoomed + plain
    raise AssertionError(f"only {len(zoomed)} of 40 trajectories zoomed in")


def _batch(samples):
    return build_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                       [s.logprobs for s in samples], images=[s.images for s in samples],
                       loss_masks=[s.loss_mask for s in samples])


def _config(model_dir, *overrides):
    return load_config(None, [f"model.path={model_dir}", "data.train_files=[unused.parquet]", "rollout.n=4",
                              "data.batch_size=1", "actor.ppo_mini_batch_size=1", "actor.micro_batch_size=8",
                              "actor.lr=1e-2", f"rollout.temperature={TEMPERATURE}", *overrides])


def _tool_spans(samples, width) -> torch.Tensor:
    spans = torch.zeros(len(samples), width, dtype=torch.bool)
    for row, sample in enumerate(samples):
        for turn in sample.turn_list():
            spans[row, turn.start:turn.end] = not turn.generated
    return spans


def test_trainer_logprobs_across_a_zoom_equal_the_engines(megatron_single_rank, vl_dir, trajectories):
    batch = _batch(trajectories)
    tool = _tool_spans(trajectories, batch.response_mask.shape[1])
    image_pad = AutoTokenizer.from_pretrained(vl_dir).convert_tokens_to_ids("<|image_pad|>")
    assert (batch.response_ids[tool] == image_pad).sum() >= 3  # the crops' image tokens, inside the responses
    assert batch.response_mask[tool].sum() == 0
    second_turn = torch.zeros_like(tool)
    for row, sample in enumerate(trajectories[:3]):
        second_turn[row, sample.turn_list()[-1].start:len(sample.response_ids)] = True
    for packed in ("false", "true"):
        worker = PolicyWorker(PolicySettings.of(_config(vl_dir, f"actor.pack_sequences={packed}")))
        logprobs = worker.compute_logprobs(batch)
        diff = (logprobs - batch.rollout_logprobs).abs() * batch.response_mask
        assert diff.sum() / batch.response_mask.sum() <= 1e-6, packed
        assert diff.max().item() <= 1e-5, packed
        assert diff[second_turn].numel() >= 3 and diff[second_turn].max().item() <= 1e-5, packed


def test_the_second_turn_sees_the_zoomed_image(megatron_single_rank, vl_dir, trajectories):
    """Another picture in the crop's place (same size, so the same tokens) changes the second turn's log-probs
    and nothing before the crop: the trainer feeds the tool's image at its tokens."""
    worker = PolicyWorker(PolicySettings.of(_config(vl_dir)))
    batch = _batch(trajectories[:1])
    first_end = trajectories[0].turn_list()[0].end
    original = worker.compute_logprobs(batch)
    crop = Image.open(io.BytesIO(batch.images[0][1]))
    batch.images = [(batch.images[0][0], _png(crop.width, crop.height, (20, 200, 40)))]
    swapped = worker.compute_logprobs(batch)
    assert torch.equal(swapped[0, :first_end], original[0, :first_end])
    second = trajectories[0].turn_list()[-1]
    assert (swapped[0, second.start:second.end] - original[0, second.start:second.end]).abs().max() > 1e-4


def test_tool_tokens_and_their_image_get_no_gradient(megatron_single_rank, vl_dir, trajectories):
    """Whatever the advantages and log-probs on the tool's tokens (its image's tokens among them), the gradient is
    bit for bit the same; on generated tokens the same change moves it."""
    batch = _batch(trajectories)
    tool = _tool_spans(trajectories, batch.response_mask.shape[1])
    batch.old_logprobs = batch.rollout_logprobs - 0.05
    batch.advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    batch.advantages *= batch.response_mask

    def gradient(changed_tokens: torch.Tensor) -> torch.Tensor:
        changed = batch.select(slice(None))
        noise = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(1)) * changed_tokens
        changed.advantages = batch.advantages + 5 * noise
        changed.old_logprobs = batch.old_logprobs + noise
        worker = PolicyWorker(PolicySettings.of(_config(vl_dir, "actor.entropy_coeff=0.01")))
        worker.accumulate_gradients(changed)
        return torch.cat([p.main_grad.flatten().cpu() for p in worker.models[0].parameters()])

    plain = gradient(torch.zeros_like(tool))
    assert plain.abs().sum() > 0
    assert torch.equal(gradient(tool), plain)
    assert (gradient(batch.response_mask.bool()) - plain).abs().max() > 1e-4


def test_tool_image_bounds_must_lie_within_the_models(vl_dir):
    from rl360.agents.build import agent_from_config
    from rl360.config import ConfigError

    base = [f"model.path={vl_dir}", "data.train_files=[x.parquet]", "agent.loop=tools", "agent.tools=[image_zoom_in]"]
    with pytest.raises(ConfigError, match=rf"agent.max_pixels=1003520.*\({MIN_PIXELS} \.\.\. {MAX_PIXELS} pixels"):
        agent_from_config(load_config(None, base))
    agent = agent_from_config(load_config(None, base + [f"agent.max_pixels={MAX_PIXELS}"]))
    assert agent.settings.max_pixels == MAX_PIXELS
    with pytest.raises(ConfigError, match="agent.min_pixels=100"):
        agent_from_config(load_config(None, base + [f"agent.max_pixels={MAX_PIXELS}", "agent.min_pixels=100"]))
