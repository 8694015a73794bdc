"""`rl360 serve rollout` as a real process on 127.0.0.1 (a tiny Qwen2), driven by `EngineClient`."""

import asyncio
import json
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


def test_max_new_tokens_zero_scores_the_given_tokens_without_generating(served):
    """A teacher's request (SGLang's form: prefill only): the log-probs of given tokens from each row's start."""
    url, model_dir = served
    rows, starts = [[4, 5, 6, 7, 8], [9, 10, 11]], [2, 1]
    body = {"input_ids": rows, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True, "logprob_start_len": starts}
    replies = httpx.post(f"{url}/generate", json=body, headers=AUTH, timeout=60).json()
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for ids, start, reply in zip(rows, starts, replies):
        meta = reply["meta_info"]
        assert reply["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
        assert [entry[1] for entry in meta["input_token_logprobs"]] == ids[start:]
        with torch.no_grad():
            plain = torch.log_softmax(reference(torch.tensor([ids])).logits[0], -1)
        expected = [float(plain[k - 1, ids[k]]) for k in range(start, len(ids))]
        torch.testing.assert_close(torch.tensor([e[0] for e in meta["input_token_logprobs"]]),
                                   torch.tensor(expected), atol=1e-5, rtol=0)


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
    ({"input_ids": [1], "modle": None}, "modle"),  # not a field of SGLang's GenerateReqInput
    ({"input_ids": [1], "return_hidden_states": True}, "return_hidden_states"),
    ({"input_ids": [[1], [2]], "return_routed_experts": [False, True]}, "return_routed_experts"),
    ({"input_ids": [1], "lora_path": "/adapters/a"}, "lora_path"),
    ({"input_ids": [1], "sampling_params": {"json_schema": "{}"}}, "sampling_params.json_schema"),
    ({"input_ids": [1], "top_logprobs_num": 21, "return_logprob": True}, "top_logprobs_num"),
    ({"input_ids": [[1], [2]], "return_logprob": [True]}, "return_logprob"),
    ({"input_ids": [1], "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}, "top_logprobs_num"),
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


# sglang-router 0.3.2's forwarded body around SGLang's own fields, with SGLang's other fields at their off values
ROUTER_BODY = {"model": None, "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
               "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
               "return_entropy": False, "lora_path": None, "session_params": None, "priority": 3,
               "custom_labels": {"team": "rl"}}


def test_sglangs_whole_request_is_accepted_and_ignored_fields_change_nothing(served):
    url, _ = served
    body = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 4, "temperature": 0.8, "sampling_seed": 9,
                                                        "stream_interval": 4, "logit_bias": None},
            "return_logprob": True}
    plain = httpx.post(f"{url}/generate", json=body, headers=AUTH, timeout=60).json()
    full = httpx.post(f"{url}/generate", json={**ROUTER_BODY, **body}, headers=AUTH, timeout=60).json()
    assert full["output_ids"] == plain["output_ids"] and len(plain["output_ids"]) == 4
    assert full["meta_info"]["output_token_logprobs"] == plain["meta_info"]["output_token_logprobs"]


def test_stream_sends_each_step_then_the_whole_reply_then_done(served):
    url, _ = served
    body = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 24, "temperature": 0.9, "sampling_seed": 2},
            "return_logprob": True}
    whole = httpx.post(f"{url}/generate", json=body, headers=AUTH, timeout=60).json()
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, headers=AUTH, timeout=60) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    lengths = [len(chunk["output_ids"]) for chunk in chunks]
    # grows step by step (steps decoded while the event loop was busy arrive together: on a loaded machine, fewer
    # chunks than tokens)
    assert lengths == sorted(lengths) and len(chunks) >= 2
    assert all(chunk["meta_info"]["finish_reason"] is None for chunk in chunks[:-1])
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert chunks[-1]["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]


def test_batch_stream_tags_each_chunk_with_its_row(served):
    url, _ = served
    body = {"input_ids": [[4, 5], [6, 7]], "sampling_params": {"max_new_tokens": 3, "n": 2}, "stream": True}
    with httpx.stream("POST", f"{url}/generate", json=body, headers=AUTH, timeout=60) as reply:
        events = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(event) for event in events[:-1]]
    finished = {chunk["index"]: chunk for chunk in chunks if chunk["meta_info"]["finish_reason"] is not None}
    assert sorted(finished) == [0, 1, 2, 3] and all(len(c["output_ids"]) == 3 for c in finished.values())


def test_top_logprobs_are_the_most_likely_tokens_of_each_step(served):
    url, _ = served
    body = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "return_logprob": True,
            "top_logprobs_num": 3}
    meta = httpx.post(f"{url}/generate", json=body, headers=AUTH, timeout=60).json()["meta_info"]
    assert len(meta["output_top_logprobs"]) == 3
    for chosen, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert len(top) == 3 and [entry[0] for entry in top] == sorted((entry[0] for entry in top), reverse=True)
        assert top[0][1] == chosen[1] and abs(top[0][0] - chosen[0]) < 1e-6  # greedy: the most likely token


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info", "/model_info", "/get_model_info"])
def test_info_routes_answer_as_sglangs(served, path):
    url, model_dir = served
    assert httpx.get(f"{url}{path}").status_code == 401
    info = httpx.get(f"{url}{path}", headers=AUTH, timeout=30).json()
    assert info["model_path"] == model_dir and info["weight_version"].isdigit()
    if "server_info" in path:
        assert info["tp_size"] == info["dp_size"] == 1 and info["version"] == "0.5.17"
        assert info["internal_states"][0]["num_running_reqs"] == 0
