"""The Megatron policy on a tiny Qwen2.5-VL: engine and trainer agree on image prompts, packing and micro-batch
splits change nothing, a sampled image token in a response is text, and `actor.freeze_vision_tower` holds."""

import pytest
import torch
from safetensors.torch import load_file

from rl360.actor.batch import build_batch
from rl360.actor.policy import PolicyWorker
from rl360.actor.settings import PolicySettings
from rl360.config import load_config
from rl360.core import ImagePrompt, SamplingParams
from rl360.data.images import VisionProcessor
from rl360.engine.hf_engine import HFEngine
from rl360.quickstart.vision_assets import build_vision_quickstart_model
from tests.helpers import png_bytes

QUESTION = "What colour?"


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return str(build_vision_quickstart_model(tmp_path_factory.mktemp("vl") / "model", texts=[QUESTION], seed=2))


@pytest.fixture(scope="module")
def rollouts(vl_dir):
    """Sampled groups for two image prompts (one and two images) and a text prompt, with advantages."""
    processor = VisionProcessor.from_pretrained(vl_dir)
    red, green = png_bytes(56, 56, (210, 20, 20)), png_bytes(84, 56, (20, 190, 30))
    blue = png_bytes(28, 28, (0, 0, 250))
    prompts = [ImagePrompt(processor.render([{"role": "user", "content": f"<image>{QUESTION}"}], [red]), (red,)),
               processor.render([{"role": "user", "content": QUESTION}]),
               ImagePrompt(processor.render([{"role": "user", "content": f"<image><image>{QUESTION}"}],
                                            [green, blue]), (green, blue))]
    groups = HFEngine(vl_dir).generate(prompts, SamplingParams(n=3, max_new_tokens=6, temperature=0.9, seed=5))
    samples = [sample for group in groups for sample in group]
    batch = build_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                        [s.logprobs for s in samples], images=[s.images for s in samples])
    batch.advantages = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(0)) * batch.response_mask
    batch.old_logprobs = batch.rollout_logprobs.clone()
    return batch


def _config(model_dir, *overrides):
    return load_config(None, [f"model.path={model_dir}", "data.train_files=[unused.parquet]", "rollout.n=3",
                              "data.batch_size=3", "actor.ppo_mini_batch_size=3", "actor.micro_batch_size=9",
                              "actor.lr=1e-2", "rollout.temperature=0.9", *overrides])


def _gradients(worker, batch) -> dict[str, torch.Tensor]:
    worker.accumulate_gradients(batch)
    return {name: param.main_grad.clone() for name, param in worker.models[0].named_parameters()
            if param.requires_grad}


def test_trainer_logprobs_equal_engine_logprobs_padded_and_packed(megatron_single_rank, vl_dir, rollouts):
    assert rollouts.has_images and not all(rollouts.images)  # image rows and text rows together
    for packed in ("false", "true"):
        worker = PolicyWorker(PolicySettings.of(_config(vl_dir, f"actor.pack_sequences={packed}")))
        logprobs = worker.compute_logprobs(rollouts)
        diff = (logprobs - rollouts.rollout_logprobs).abs() * rollouts.response_mask
        assert diff.sum() / rollouts.response_mask.sum() <= 1e-6, packed
        assert diff.max().item() <= 1e-5, packed


def test_packing_and_micro_batch_splits_give_the_same_gradients(megatron_single_rank, vl_dir, rollouts):
    runs = [("false", 9), ("false", 2), ("true", 4)]
    grads = [_gradients(PolicyWorker(PolicySettings.of(_config(vl_dir, f"actor.pack_sequences={packed}",
                                             f"actor.micro_batch_size={micro}"))), rollouts) for packed, micro in runs]
    assert any(".vision." in name and grad.abs().sum() > 0 for name, grad in grads[0].items())
    for other in grads[1:]:
        for name, grad in grads[0].items():
            assert (other[name] - grad).abs().max().item() <= 1e-6 * max(1.0, grad.abs().max().item()), name


def _text_response_logprobs(model_dir, batch, temperature=0.9) -> torch.Tensor:
    """transformers' log-probs of row 0's response with its prompt's images placed at the prompt's image tokens only
    and every response token embedded as a word, whatever its id (what the engines feed back while decoding)."""
    from transformers import AutoModelForImageTextToText

    from megatron_bridge.mrope import mrope_positions

    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = VisionProcessor.from_pretrained(model_dir)
    start, length = int(batch.response_start[0]), int(batch.response_mask[0].sum())
    ids = batch.input_ids[0, :start + length]
    pixels = processor.pixel_inputs(list(batch.images[0]))
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids[None]).clone()
        features = torch.cat(model.model.get_image_features(pixels["pixel_values"],
                                                            pixels["image_grid_thw"]).pooler_output)
        in_prompt = (ids == model.config.image_token_id) & (torch.arange(len(ids)) < start)
        embeds[0, in_prompt] = features
        positions = mrope_positions(ids, pixels["image_grid_thw"], model.config.image_token_id,
                                    processor.merge_size, text_from=start)[:, None]
        logits = model(inputs_embeds=embeds, position_ids=positions).logits[0, start - 1:start + length - 1]
    return torch.log_softmax(logits / temperature, -1).gather(-1, ids[start:, None])[:, 0]


def test_an_image_token_sampled_in_a_response_is_text(megatron_single_rank, vl_dir, rollouts):
    """The engines embed a sampled image-token id as a token; the trainer must not take it for an image."""
    worker = PolicyWorker(PolicySettings.of(_config(vl_dir)))
    image_token = worker.bridge.image_token_id
    row = next(i for i, images in enumerate(rollouts.images) if images and rollouts.response_mask[i].sum() >= 3)
    batch = rollouts.select(torch.tensor([row]))
    batch.input_ids[0, batch.response_start[0] + 1] = image_token
    batch.response_ids[0, 1] = image_token
    changed = worker.compute_logprobs(batch)
    original = worker.compute_logprobs(rollouts.select(torch.tensor([row])))
    assert torch.equal(changed[0, :1], original[0, :1])  # causal: what comes before it is untouched
    length = int(batch.response_mask[0].sum())
    assert (changed[0, :length] - _text_response_logprobs(vl_dir, batch)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("freeze", [True, False])
def test_freeze_vision_tower_keeps_the_tower_as_loaded(megatron_single_rank, vl_dir, rollouts, tmp_path, freeze):
    worker = PolicyWorker(PolicySettings.of(_config(vl_dir, f"actor.freeze_vision_tower={str(freeze).lower()}")))
    worker.update(rollouts)
    worker.save_hf(str(tmp_path / "hf"))
    before, after = load_file(f"{vl_dir}/model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    vision = [name for name in before if name.startswith("visual.")]
    assert all(torch.equal(before[name], after[name]) for name in vision) == freeze
    assert not torch.equal(before["model.layers.0.mlp.up_proj.weight"], after["model.layers.0.mlp.up_proj.weight"])
