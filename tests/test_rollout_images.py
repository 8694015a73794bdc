"""Vision-language rollouts: the HF engine in-process, and `rl360 serve rollout` as a real process driven by
`EngineClient`, on a tiny random Qwen2.5-VL (`rl360.quickstart.vision_assets`).

The engine's log-prob of every sampled token must equal a plain full-sequence transformers forward of prompt +
response with the same pixel inputs (what the trainer computes), for batches mixing image prompts of different
image sizes with text prompts; weights arrive in checkpoint (file) names, vision tower included, through the
engine and through every weight-sync strategy of the server."""

import asyncio
import base64
import io
import os
import shutil
import subprocess
import sys

import httpx
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForImageTextToText

from rl360.core import ImagePrompt, SamplingParams
from rl360.core.client import EngineClient, EngineError, collapse_image_tokens, image_data_url
from rl360.data.images import VisionProcessor
from rl360.engine.hf_engine import HFEngine
from rl360.quickstart.vision_assets import VISION_TOKENS, build_vision_quickstart_model
from rl360.serve.loadgen import metric_total
from rl360.weight_sync.sender import WeightSender
from tests.helpers import serving_url

KEY = "rollout-images-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUESTION = "Which colour fills most of the image?"
STRATEGIES = ("distributed", "tensor", "disk")
WHOLE = 1 << 30


def _image(width: int, height: int, seed: int, kind: str = "PNG") -> bytes:
    """A noisy image (so every patch differs), compressed."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, kind)
    return out.getvalue()


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """The model directory, its processor and three prompts: one 56x56 PNG (4 image tokens), one 112x84 JPEG and
    one 28x28 PNG together in one prompt, and a text prompt."""
    model_dir = str(build_vision_quickstart_model(tmp_path_factory.mktemp("vl") / "model", texts=[QUESTION], seed=3))
    processor = VisionProcessor.from_pretrained(model_dir)
    small, wide, tiny = _image(56, 56, 1), _image(112, 84, 2, "JPEG"), _image(28, 28, 3)
    one = ImagePrompt(processor.render([{"role": "user", "content": f"<image>{QUESTION}"}], [small]), (small,))
    two = ImagePrompt(processor.render([{"role": "user", "content": f"<image> and <image>{QUESTION}"}],
                                       [wide, tiny]), (wide, tiny))
    text = processor.render([{"role": "user", "content": QUESTION}])
    return model_dir, processor, [one, text, two]


def _reference_logprobs(model, processor, prompt_ids, images, response, temperature):
    """Trainer-style: one plain forward of prompt + response with the images' pixel inputs (the last response
    token is no input to any of the predictions, and leaving it out lets it be a vision token: the tests stop
    there, as a sampled image token past the prompt would not match any image)."""
    ids = torch.tensor([list(prompt_ids) + list(response[:-1])])
    inputs = {}
    if images:
        pixels = processor.pixel_inputs(list(images))
        inputs = {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"],
                  "mm_token_type_ids": (ids == model.config.image_token_id).int()}
    with torch.no_grad():
        logits = model(input_ids=ids, **inputs).logits[0, len(prompt_ids) - 1:].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), -1)
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0], logits


def _vision_stops(model_dir: str) -> list[int]:
    """The vision special tokens (image pad, vision start/end, video pad): the tests stop sampling at them."""
    processor = VisionProcessor.from_pretrained(model_dir)
    return [processor.tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS]


def _check_against_reference(model, processor, prompts, groups, temperature, at_least=16):
    """Every sample's log-probs against the reference forward; mean abs difference <= 1e-6 over all tokens (at
    least `at_least` of them)."""
    differences = []
    for prompt, group in zip(prompts, groups):
        for sample in group:
            images = prompt.images if isinstance(prompt, ImagePrompt) else None
            assert sample.images == images
            assert sample.prompt_ids == (prompt.ids if images else prompt)
            expected, _ = _reference_logprobs(model, processor, sample.prompt_ids, images, sample.response_ids,
                                              temperature)
            differences.append((torch.tensor(sample.logprobs) - expected).abs())
    every = torch.cat(differences)
    assert every.numel() >= at_least
    assert float(every.mean()) <= 1e-6 and float(every.max()) <= 1e-5, (float(every.mean()), float(every.max()))


def test_engine_logprobs_equal_a_plain_forward_with_the_images(vl):
    model_dir, processor, prompts = vl
    engine = HFEngine(model_dir)
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=6, seed=5, stop_token_ids=_vision_stops(model_dir))
    groups = engine.generate(prompts, params)
    assert [len(group) for group in groups] == [2, 2, 2]
    reference = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    _check_against_reference(reference, processor, prompts, groups, 0.8)
    # an aborted image sample continues from its prompt + response with its images (Sample.continuation)
    first = groups[2][0]
    continued = first.continuation()
    assert isinstance(continued, ImagePrompt) and continued.images == prompts[2].images
    assert first.finish_reason == "length"  # no vision token inside the continued prompt's response
    more = engine.generate([continued, prompts[1]], SamplingParams(n=1, temperature=0.8, max_new_tokens=4, seed=9,
                                                                   stop_token_ids=params.stop_token_ids))
    _check_against_reference(reference, processor, [continued, prompts[1]], more, 0.8, at_least=4)


def test_engine_greedy_decodes_the_plain_argmax(vl):
    model_dir, processor, prompts = vl
    engine = HFEngine(model_dir)
    groups = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=5,
                                                     stop_token_ids=_vision_stops(model_dir)))
    reference = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    for prompt, (sample,) in zip(prompts, groups):
        images = prompt.images if isinstance(prompt, ImagePrompt) else None
        _, logits = _reference_logprobs(reference, processor, sample.prompt_ids, images, sample.response_ids, 0.0)
        assert sample.response_ids == logits.argmax(-1).tolist()


def test_image_prompts_that_do_not_fit_are_refused_by_name(vl, tmp_path):
    model_dir, processor, prompts = vl
    engine = HFEngine(model_dir)
    small = prompts[0].images[0]
    coarse = VisionProcessor.from_pretrained(model_dir, max_pixels=28 * 28)  # other min/max pixels than the engine's
    wrong = ImagePrompt(coarse.render([{"role": "user", "content": f"<image>{QUESTION}"}], [small]), (small,))
    with pytest.raises(ValueError, match=r"prompt 1: its ids hold image-token runs of lengths \[1\].*\[4\]"):
        engine.generate([prompts[1], wrong], SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="prompt 0 holds the image token"):
        engine.generate([prompts[0].ids], SamplingParams(max_new_tokens=1))
    from tests.helpers import make_tiny_qwen2

    text_engine = HFEngine(make_tiny_qwen2(str(tmp_path / "text"), tie_word_embeddings=False))
    with pytest.raises(ValueError, match="prompt 0 has 1 image.*text model"):
        text_engine.generate([ImagePrompt([5, 6], (small,))], SamplingParams(max_new_tokens=1))


def _file_weights(model_dir: str, scale: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under their file names (`model.layers.*`, `visual.*`), as the bridge exports them."""
    files = sorted(name for name in os.listdir(model_dir) if name.endswith(".safetensors"))
    named = [pair for name in files for pair in load_file(os.path.join(model_dir, name)).items()]
    generator = torch.Generator().manual_seed(int(scale * 1000))
    return [(name, tensor * scale + (0.02 * torch.randn(tensor.shape, generator=generator) if scale != 1.0 else 0))
            for name, tensor in named]


def _saved_with(model_dir: str, named: list[tuple[str, torch.Tensor]], out_dir) -> str:
    """A copy of `model_dir` whose checkpoint holds exactly `named` (file names): a model loaded with them."""
    shutil.copytree(model_dir, out_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    save_file({name: tensor.contiguous() for name, tensor in named}, os.path.join(out_dir, "model.safetensors"))
    return str(out_dir)


def test_engine_weight_update_in_file_names_changes_outputs_and_round_trips(vl, tmp_path):
    model_dir, processor, prompts = vl
    engine = HFEngine(model_dir)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=5, stop_token_ids=_vision_stops(model_dir))
    before = engine.generate(prompts, greedy)
    original, moved = _file_weights(model_dir), _file_weights(model_dir, scale=1.5)
    names = [name for name, _ in original]
    assert any(name.startswith("visual.") for name in names) and any(name.startswith("model.layers.") for name in names)
    assert not any(name.startswith("model.language_model.") for name in names)  # file names, not module names
    engine.update_weights(moved[:10], version=1)
    engine.update_weights(moved[10:], version=1)
    assert engine.finish_weight_update(1) == 1
    for name, tensor in moved:
        assert torch.equal(engine.model.get_parameter(engine.parameter_name(name)).detach(), tensor), name
    after = engine.generate(prompts, greedy)
    assert [g[0].logprobs for g in after] != [g[0].logprobs for g in before]
    loaded = AutoModelForImageTextToText.from_pretrained(_saved_with(model_dir, moved, tmp_path / "moved")).eval()
    _check_against_reference(loaded, processor, prompts, after, 0.0, at_least=3)
    visual_only = [(name, tensor) for name, tensor in original if name.startswith("visual.")]
    engine.update_weights(visual_only, version=2)
    with pytest.raises(RuntimeError, match="left parameters unset: \\['model.language_model"):
        engine.finish_weight_update(2)
    with pytest.raises(KeyError, match="visual.no_such_block"):
        engine.update_weights([("visual.no_such_block.weight", torch.zeros(1))], version=2)
    engine.update_weights(original, version=3)
    assert engine.finish_weight_update(3) == 3
    again = engine.generate(prompts, greedy)
    assert [g[0].response_ids for g in again] == [g[0].response_ids for g in before]
    assert [g[0].logprobs for g in again] == [g[0].logprobs for g in before]


@pytest.fixture(scope="module")
def qwen2_vl(vl, tmp_path_factory):
    """A tiny Qwen2-VL (untied embeddings, as Qwen2-VL-7B ships) with the quickstart's tokenizer and image
    processor, so `vl`'s prompts are its prompts too."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    source = AutoConfig.from_pretrained(vl[0])
    out_dir = tmp_path_factory.mktemp("qwen2vl") / "model"
    weights_and_config = ("*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json")
    shutil.copytree(vl[0], out_dir, ignore=shutil.ignore_patterns(*weights_and_config))
    text = {key: getattr(source.text_config, key) for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "rope_parameters", "eos_token_id", "pad_token_id")}
    vision = {"depth": 2, "embed_dim": 32, "hidden_size": text["hidden_size"], "mlp_ratio": 2, "num_heads": 2,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "initializer_range": 0.1}
    config = Qwen2VLConfig(text_config={**text, "initializer_range": 0.1}, vision_config=vision,
                           tie_word_embeddings=False, image_token_id=source.image_token_id,
                           video_token_id=source.video_token_id, vision_start_token_id=source.vision_start_token_id,
                           vision_end_token_id=source.vision_end_token_id)
    torch.manual_seed(7)
    Qwen2VLForConditionalGeneration(config).save_pretrained(str(out_dir))
    return str(out_dir)


def test_qwen2_vl_engine_logprobs_and_a_vision_tower_update(vl, qwen2_vl, tmp_path):
    """Qwen2-VL samples with the trainer's log-probs; an update whose only new tensors are `visual.*` (checkpoint
    names) changes what image prompts give, leaves the text prompt's samples as they were, and gives what a model
    loaded with those weights gives."""
    _, processor, prompts = vl
    engine = HFEngine(qwen2_vl)
    assert type(engine.model).__name__ == "Qwen2VLForConditionalGeneration"
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=5, seed=3, stop_token_ids=_vision_stops(qwen2_vl))
    reference = AutoModelForImageTextToText.from_pretrained(qwen2_vl).eval()
    _check_against_reference(reference, processor, prompts, engine.generate(prompts, params), 0.8)

    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=5, stop_token_ids=params.stop_token_ids)
    before = engine.generate(prompts, greedy)
    named = _file_weights(qwen2_vl)
    assert any(name == "lm_head.weight" for name, _ in named)  # untied: the head is a checkpoint tensor
    generator = torch.Generator().manual_seed(11)
    vision_moved = [(name, tensor * 1.3 + 0.02 * torch.randn(tensor.shape, generator=generator)
                     if name.startswith("visual.") else tensor) for name, tensor in named]
    engine.update_weights(vision_moved, version=1)
    assert engine.finish_weight_update(1) == 1
    after = engine.generate(prompts, greedy)
    assert after[1][0].logprobs == before[1][0].logprobs  # the text prompt never meets the vision tower
    assert after[0][0].logprobs != before[0][0].logprobs and after[2][0].logprobs != before[2][0].logprobs
    loaded = AutoModelForImageTextToText.from_pretrained(_saved_with(qwen2_vl, vision_moved, tmp_path / "m")).eval()
    _check_against_reference(loaded, processor, prompts, after, 0.0, at_least=3)


# ---- rl360 serve rollout ----
def _launch(model_dir: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "rl360.cli", "serve", "rollout", "--model", model_dir, "--port",
                             "0", "--api-key-env", "RL360_TEST_ROLLOUT_KEY", "--batch-window-ms", "20",
                             "--weight-sync-timeout-s", "30", "--shutdown-grace", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RL360_TEST_ROLLOUT_KEY": KEY, "OMP_NUM_THREADS": "1"})
    return proc, serving_url(proc)


@pytest.fixture(scope="module")
def served(vl):
    proc, url = _launch(vl[0])
    yield url
    proc.terminate()
    proc.communicate(timeout=30)


def _run(coro):
    return asyncio.run(coro)


async def _with_client(url, fn):
    async with EngineClient(url, api_key=KEY, timeout_s=120) as client:
        return await fn(client)


def test_server_samples_image_prompts_with_trainer_logprobs(vl, served):
    model_dir, processor, prompts = vl
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=5, stop_token_ids=_vision_stops(model_dir))
    groups = _run(_with_client(served, lambda c: c.generate_samples(prompts, params, seed=11)))
    reference = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    _check_against_reference(reference, processor, prompts, groups, 0.9)
    in_process = HFEngine(model_dir).generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=4))
    served_greedy = _run(_with_client(served, lambda c: c.generate_samples(
        prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=4))))
    assert [g[0].response_ids for g in served_greedy] == [g[0].response_ids for g in in_process]


def test_server_takes_sglangs_image_payloads(vl, served):
    """The payload SGLang documents: input_ids with one image token per image, image_data as base64 or data URLs
    in its single and batch shapes; the reply's prompt_token_ids are the expanded ids."""
    _, processor, prompts = vl
    one, text, two = prompts
    token = processor.image_token_id
    collapsed_one = collapse_image_tokens(one.ids, token, 1)
    collapsed_two = collapse_image_tokens(two.ids, token, 2)
    assert collapsed_one.count(token) == 1 and len(collapsed_one) == len(one.ids) - 3  # 4 image tokens -> 1
    greedy = {"temperature": 0, "max_new_tokens": 3}
    plain = base64.b64encode(one.images[0]).decode()
    bodies = [  # (body, expected prompt_token_ids per reply)
        ({"input_ids": collapsed_one, "image_data": plain}, [one.ids]),
        ({"input_ids": collapsed_one, "image_data": [image_data_url(one.images[0])]}, [one.ids]),
        ({"input_ids": [collapsed_one, text, collapsed_two],
          "image_data": [[plain], [], [image_data_url(data) for data in two.images]]}, [one.ids, text, two.ids]),
        ({"input_ids": [collapsed_one, text], "image_data": [plain, None]}, [one.ids, text]),
    ]
    replies = []
    for body, expected in bodies:
        answer = httpx.post(f"{served}/generate", json={**body, "sampling_params": greedy, "return_logprob": True,
                                                        "return_prompt_token_ids": True}, headers=AUTH, timeout=120)
        assert answer.status_code == 200, answer.text
        reply = answer.json()
        reply = reply if isinstance(reply, list) else [reply]
        assert [r["prompt_token_ids"] for r in reply] == expected
        assert [r["meta_info"]["prompt_tokens"] for r in reply] == [len(ids) for ids in expected]
        assert all(len(r["output_ids"]) == 3 and len(r["meta_info"]["output_token_logprobs"]) == 3 for r in reply)
        replies.append(reply)
    assert replies[0][0]["output_ids"] == replies[1][0]["output_ids"] == replies[2][0]["output_ids"]
    no_ids = httpx.post(f"{served}/generate", json={"input_ids": collapsed_one, "image_data": plain,
                                                    "sampling_params": greedy}, headers=AUTH, timeout=120).json()
    assert "prompt_token_ids" not in no_ids  # only when asked for, as in SGLang


@pytest.mark.parametrize("case, param", [
    ("url", "image_data[0]"), ("path", "image_data[0]"), ("file_url", "image_data[0]"), ("dict", "image_data[0]"),
    ("not_base64", "image_data[0]"), ("not_an_image", "image_data"), ("expanded_ids", "input_ids"),
    ("too_few_images", "input_ids"), ("batch_length", "image_data"), ("token_without_image", "input_ids[1]"),
])
def test_server_refuses_image_payloads_by_field(vl, served, case, param):
    _, processor, prompts = vl
    one, text, _ = prompts
    collapsed = collapse_image_tokens(one.ids, processor.image_token_id, 1)
    good = base64.b64encode(one.images[0]).decode()
    bodies = {
        "url": {"input_ids": collapsed, "image_data": ["https://example.com/cat.png"]},
        "path": {"input_ids": collapsed, "image_data": ["/etc/cat.png"]},
        "file_url": {"input_ids": collapsed, "image_data": ["file:///etc/passwd"]},
        "dict": {"input_ids": collapsed, "image_data": [{"format": "processor_output"}]},
        "not_base64": {"input_ids": collapsed, "image_data": ["not base64!"]},
        "not_an_image": {"input_ids": collapsed, "image_data": [base64.b64encode(b"plain text").decode()]},
        "expanded_ids": {"input_ids": one.ids, "image_data": [good]},
        "too_few_images": {"input_ids": collapsed + collapsed, "image_data": [good]},
        "batch_length": {"input_ids": [collapsed, text], "image_data": [[good]]},
        "token_without_image": {"input_ids": [collapsed, collapsed], "image_data": [[good], []]},
    }
    reply = httpx.post(f"{served}/generate", json=bodies[case], headers=AUTH, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_client_refuses_an_expansion_that_differs_from_the_trainers(vl, served):
    model_dir, _, prompts = vl
    small = prompts[0].images[0]
    coarse = VisionProcessor.from_pretrained(model_dir, max_pixels=28 * 28)  # the trainer resized differently
    wrong = ImagePrompt(coarse.render([{"role": "user", "content": f"<image>{QUESTION}"}], [small]), (small,))
    with pytest.raises(EngineError, match="prompt 1: the engine expanded its 1 image\\(s\\) to .* the engine's image"):
        _run(_with_client(served, lambda c: c.generate_samples([prompts[1], wrong], SamplingParams(max_new_tokens=1))))


def test_server_partial_rollouts_keep_their_images(vl, served):
    """An image request aborted at the server comes back with its images; continuations (prompt + tokens so far,
    with the images: `Sample.continuation`) go through the server again, and each whole response's log-probs are
    the trainer's."""
    model_dir, processor, prompts = vl
    stops = _vision_stops(model_dir)
    cut_at = SamplingParams(temperature=0.9, max_new_tokens=3, stop_token_ids=stops)

    async def admitted(requests: int) -> None:  # `requests` /generate calls at the server
        for _ in range(400):
            if await asyncio.to_thread(metric_total, served, "rl360_http_requests_in_flight", AUTH) >= requests:
                return
            await asyncio.sleep(0.025)
        raise AssertionError(f"{requests} requests never reached the server")

    async def scenario(client):
        await client.pause_generation("in_place")
        running = asyncio.create_task(client.generate_samples(
            [prompts[2]], SamplingParams(max_new_tokens=50, stop_token_ids=stops), seed=4, rid="img"))
        await admitted(1)
        await client.pause_generation("abort")
        [[aborted]] = await running
        await client.continue_generation()
        first = await client.generate_samples([prompts[0], prompts[2]], cut_at, seed=5)
        cut = [group[0] for group in first] + [aborted]  # stand-ins for samples a weight update cut
        more = await client.generate_samples([sample.continuation() for sample in cut], cut_at, seed=6)
        return aborted, cut, [group[0] for group in more]

    aborted, cut, more = _run(_with_client(served, scenario))
    assert aborted.finish_reason == "abort" and aborted.images == prompts[2].images
    for sample, rest in zip(cut, more):
        assert isinstance(sample.continuation(), ImagePrompt) and rest.images == sample.images
        assert rest.prompt_ids == sample.prompt_ids + sample.response_ids
    whole = [[sample.continued(rest)] for sample, rest in zip(cut, more)]
    assert [group[0].images for group in whole] == [prompts[0].images, prompts[2].images, prompts[2].images]
    reference = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    _check_against_reference(reference, processor, [prompts[0], prompts[2], prompts[2]], whole, 0.9, at_least=6)


@pytest.fixture(scope="module")
def two_servers(vl, served):
    """`served` and one more server (the weight-sync tests come last in this module: they change the weights)."""
    proc, url = _launch(vl[0])
    yield [served, url]
    proc.terminate()
    proc.communicate(timeout=30)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_weight_sync_carries_vision_weights_in_file_names(vl, two_servers, strategy, tmp_path):
    """A VL model's full set of checkpoint-named tensors (language and vision) through each strategy into two
    servers: read back bitwise by file name, served, then refused by name when the vision tower is left out."""
    model_dir, _, prompts = vl
    seed = 2.0 + STRATEGIES.index(strategy)
    named = _file_weights(model_dir, scale=seed)
    buckets = [named[i:i + 12] for i in range(0, len(named), 12)]

    async def versions(client):
        return int(await client.weight_version())

    version = max(_run(_with_client(url, versions)) for url in two_servers) + 1
    with WeightSender(list(two_servers), strategy, api_key=KEY, timeout_s=60, scratch_dir=str(tmp_path)) as sender:
        sender.send(buckets, version)
        without_vision = [pair for pair in named if not pair[0].startswith("visual.")]
        with pytest.raises(EngineError, match="left parameters unset: \\['model.visual"):
            sender.send([without_vision], version + 1)
    for url in two_servers:
        async def read(client):
            return {name: torch.tensor(await client.get_weights_by_name(name, WHOLE)) for name, _ in named}

        served = _run(_with_client(url, read))
        for name, tensor in named:
            assert torch.equal(served[name].reshape(tensor.shape), tensor), f"{url}: {name} differs"
        assert _run(_with_client(url, versions)) == version
    engine = HFEngine(model_dir)  # the same tensors loaded in-process give the same greedy samples
    engine.update_weights(named, version)
    engine.finish_weight_update(version)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=4)
    expected = [g[0].response_ids for g in engine.generate(prompts, greedy)]
    for url in two_servers:
        got = _run(_with_client(url, lambda c: c.generate_samples(prompts, greedy)))
        assert [g[0].response_ids for g in got] == expected
