"""`rl360 serve rollout` as a real process on 127.0.0.1 (a tiny Qwen2), driven by `EngineClient`."""

import asyncio
import os
import subprocess
import sys

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rl360.core import SamplingParams
from rl360.core.client import EngineClient, EngineError
from rl360.serve.loadgen import metric_total
from tests.helpers import make_tiny_qwen2, serving_url

KEY = "rollout-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = make_tiny_qwen2(str(tmp_path_factory.mktemp("rollout") / "model"), tie_word_embeddings=False, seed=3)
    proc = subprocess.Popen([sys.executable, "-m", "rl360.cli", "serve", "rollout", "--model", model_dir, "--port",
                             "0", "--api-key-env", "RL360_TEST_ROLLOUT_KEY", "--batch-window-ms", "50"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RL360_TEST_ROLLOUT_KEY": KEY})
    yield serving_url(proc), model_dir
    proc.terminate()
    proc.communicate(timeout=30)


def _run(coro):
    return asyncio.run(coro)


async def _with_client(url, fn, key=KEY):
    async with EngineClient(url, api_key=key, timeout_s=60) as client:
        return await fn(client)


def test_logprobs_are_those_of_a_plain_forward_pass(served):
    url, model_dir = served
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    groups = _run(_with_client(url, lambda c: c.generate_samples(
        prompts, SamplingParams(n=2, temperature=0.7, max_new_tokens=5), seed=4)))
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for prompt, group in zip(prompts, groups):
        assert len(group) == 2
        for sample in group:
            assert len(sample.response_ids) == len(sample.logprobs) == 5 and sample.finish_reason == "length"
            with torch.no_grad():
                logits = reference(torch.tensor([prompt + sample.response_ids])).logits[0, len(prompt) - 1:-1] / 0.7
            expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(sample.response_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-5, rtol=0)


def test_reply_shape_and_input_logprobs_follow_sglang(served):
    url, model_dir = served
    body = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 3, "temperature": 0, "stop_token_ids": []},
            "return_logprob": True, "logprob_start_len": 0, "rid": "r1"}
    reply = httpx.post(f"{url}/generate", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()
    meta = reply["meta_info"]
    assert isinstance(reply["output_ids"], list) and len(reply["output_ids"]) == 3 and reply["text"] == ""
    assert meta["id"] == "r1" and meta["finish_reason"] == {"type": "length", "length": 3}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 3 and meta["weight_version"] == "0"
    assert [entry[1] for entry in meta["output_token_logprobs"]] == reply["output_ids"]
    assert [entry[1] for entry in meta["input_token_logprobs"]] == [4, 5, 6]
    assert meta["input_token_logprobs"][0][0] is None
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        plain = torch.log_softmax(reference(torch.tensor([[4, 5, 6]])).logits[0], -1)
    expected = [float(plain[0, 5]), float(plain[1, 6])]
    torch.testing.assert_close(torch.tensor([e[0] for e in meta["input_token_logprobs"][1:]]), torch.tensor(expected),
                               atol=1e-5, rtol=0)


def test_concurrent_requests_batch_and_match_one_at_a_time(served):
    url, _ = served
    prompts = [[3, 4, 5, 6, 7, 8], [9], [10, 11, 12]]
    params = SamplingParams(n=1, temperature=1.0, top_k=20, top_p=0.9, max_new_tokens=6, stop_token_ids=[1, 2])

    async def both(client):
        alone = [await client.generate_samples([p], params, seed=100 + i) for i, p in enumerate(prompts)]
        together = await asyncio.gather(*[client.generate_samples([p], params, seed=100 + i)
                                          for i, p in enumerate(prompts)])
        return alone, together

    before = _batches(url)
    alone, together = _run(_with_client(url, both))
    assert _batches(url) - before == len(prompts) + 1  # one at a time, then the gathered three in one batch
    for one, many in zip(alone, together):
        assert one[0][0].response_ids == many[0][0].response_ids
        torch.testing.assert_close(torch.tensor(one[0][0].logprobs), torch.tensor(many[0][0].logprobs),
                                   atol=1e-5, rtol=0)


def _batches(url):
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("rl360_rollout_batches_total"))


def test_weight_update_by_tensors_changes_outputs_and_partial_update_names_missing(served):
    url, model_dir = served
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    params = dict(model.named_parameters())
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)

    async def scenario(client):
        before = await client.generate_samples([[7, 8, 9]], greedy)
        names = sorted(params)
        with pytest.raises(EngineError, match="left parameters unset") as missing:
            await client.update_weights_from_tensor([(names[0], params[names[0]].detach())], 5, last_bucket=True)
        assert names[1] in str(missing.value)
        assert await client.weight_version() == "0"
        changed = [(n, (p.detach() * 1.5 if "embed" in n or "lm_head" in n else p.detach())) for n, p in params.items()]
        half = len(changed) // 2
        await client.update_weights_from_tensor(changed[:half], 6, last_bucket=False)
        await client.update_weights_from_tensor(changed[half:], 6, last_bucket=True)
        after = await client.generate(([[7, 8, 9]]), {"temperature": 0, "max_new_tokens": 6})
        with pytest.raises(EngineError, match="older than"):
            await client.update_weights_from_tensor(changed[:1], 2, last_bucket=True)
        await client.update_weights_from_disk(model_dir, 7)  # back to the original weights
        again = await client.generate_samples([[7, 8, 9]], greedy)
        return before, after, again

    before, after, again = _run(_with_client(url, scenario))
    assert after[0]["meta_info"]["weight_version"] == "6"
    assert after[0]["output_ids"] != before[0][0].response_ids or after[0]["meta_info"]["output_token_logprobs"] != [
        [lp, t, None] for lp, t in zip(before[0][0].logprobs, before[0][0].response_ids)]
    assert again[0][0].response_ids == before[0][0].response_ids


def test_abort_pause_and_continue(served):
    """Each request is known to be at the server (its in-flight gauge) before it is aborted or held, so no step
    depends on how fast the engine decodes."""
    url, _ = served
    long = SamplingParams(n=1, temperature=1.0, max_new_tokens=100)

    async def admitted(requests: int) -> None:  # `requests` /generate calls admitted (/metrics is not counted)
        for _ in range(400):
            if await asyncio.to_thread(metric_total, url, "rl360_http_requests_in_flight", AUTH) >= requests:
                return
            await asyncio.sleep(0.025)
        raise AssertionError(f"{requests} requests never reached the server")

    async def scenario(client):
        await client.pause_generation("in_place")
        running = asyncio.create_task(client.generate_samples([[5, 6]], long, seed=1, rid="job"))
        await admitted(1)
        await client.abort_request(rid="job-0")
        aborted = await running
        held = asyncio.create_task(client.generate_samples([[5, 6]], SamplingParams(max_new_tokens=4), seed=2))
        await admitted(1)
        assert not held.done()  # paused: nothing decodes
        await client.continue_generation()
        resumed = await held
        await client.pause_generation("in_place")
        running = asyncio.create_task(client.generate_samples([[5, 6]], long, seed=1))
        await admitted(1)
        await client.pause_generation("abort")
        paused_abort = await running
        await client.continue_generation()
        return aborted, resumed, paused_abort, await client.health_generate()

    aborted, resumed, paused_abort, healthy = _run(_with_client(url, scenario))
    assert aborted[0][0].finish_reason == "abort" and len(aborted[0][0].response_ids) < 100
    assert resumed[0][0].finish_reason == "length" and len(resumed[0][0].response_ids) == 4
    assert paused_abort[0][0].finish_reason == "abort" and len(paused_abort[0][0].response_ids) < 100
    assert healthy


def test_keys_are_required(served):
    url, _ = served
    assert httpx.post(f"{url}/generate", json={"input_ids": [1]}).status_code == 401
    assert httpx.post(f"{url}/update_weights_from_tensor", json={}, headers={"Authorization": "Bearer no"}
                      ).status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200
    with pytest.raises(EngineError, match="401"):
        _run(_with_client(url, lambda c: c.model_info(), key="wrong-key-wrong-key"))
    info = _run(_with_client(url, lambda c: c.model_info()))
    assert info["is_generation"] is True and info["architectures"] == ["Qwen2ForCausalLM"]


@pytest.mark.parametrize("body, param", [
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1], "sampling_params": {"temprature": 1}}, "sampling_params.temprature"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"input_ids": [1], "sampling_params": {"repetition_penalty": 0}}, "sampling_params.repetition_penalty"),
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": -2.5}}, "sampling_params.frequency_penalty"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
    ({"input_ids": [1], "stream": True}, "stream"),
    ({"text": "hi"}, "text"),  # the tiny checkpoint has no tokenizer
])
def test_bad_generate_requests_name_the_field(served, body, param):
    url, _ = served
    reply = httpx.post(f"{url}/generate", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_pickled_tensor_formats_are_refused(served):
    url, _ = served
    reply = httpx.post(f"{url}/update_weights_from_tensor", json={"serialized_named_tensors": ["gASV"],
                                                                  "load_format": "flattened_bucket"},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "load_format"
