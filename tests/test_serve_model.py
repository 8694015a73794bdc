"""`rl360 serve model` (a real server process on the quickstart model) answering the OpenAI API, and the
LLM-judge client talking to it."""

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from transformers import AutoTokenizer

from rl360.data import PromptRenderer
from rl360.quickstart.assets import build_quickstart_model
from rl360.rewards.judge import JudgeClient, JudgeItem
from rl360.serve.loadgen import MemorySampler, burst, metric_total, service_command, start_service

KEY = "sk-serve-test-key-4242"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = build_quickstart_model(tmp_path_factory.mktemp("serve") / "model")
    proc = subprocess.Popen([sys.executable, "-m", "rl360.cli", "serve", "model", "--model", str(model_dir),
                             "--port", "0", "--served-model-name", "tiny", "--api-key-env", "RL360_TEST_SERVE_KEY"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RL360_TEST_SERVE_KEY": KEY})
    seen = []
    while not seen or "serving" not in seen[-1]:  # "rl360 serving model 'tiny' ... on http://127.0.0.1:PORT/v1 ..."
        seen.append(proc.stdout.readline())
        assert seen[-1], "".join(seen)  # the server exited before serving
    line = seen[-1]
    assert KEY not in "".join(seen)
    yield line.split(" on ", 1)[1].split()[0], model_dir
    proc.terminate()
    rest = proc.communicate(timeout=30)[0]
    assert KEY not in rest


def _chat(url, **body):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "3+4"}], **body}
    return httpx.post(f"{url}/chat/completions", json=body, headers=AUTH, timeout=60)


def test_chat_completions_follow_the_openai_shape_and_sampling_settings(served):
    url, model_dir = served
    reply = _chat(url, n=2, max_tokens=4, seed=5).json()
    assert reply["object"] == "chat.completion" and reply["model"] == "tiny"
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    for choice in reply["choices"]:
        assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] in ("stop", "length")
    rendered = PromptRenderer(AutoTokenizer.from_pretrained(model_dir), 1 << 30).render(
        [{"role": "user", "content": "3+4"}])
    usage = reply["usage"]
    assert usage["prompt_tokens"] == len(rendered)
    assert 2 <= usage["completion_tokens"] <= 8 and usage["total_tokens"] == len(rendered) + usage["completion_tokens"]
    assert _chat(url, n=2, max_tokens=4, seed=5).json()["choices"] == reply["choices"]  # same seed, same replies
    greedy = [_chat(url, temperature=0, max_tokens=6).json()["choices"][0]["message"]["content"] for _ in range(2)]
    assert greedy[0] == greedy[1]


def test_stop_strings_cut_the_text(served):
    url, _ = served
    words = [c["message"]["content"] for c in _chat(url, n=8, max_tokens=6, seed=1).json()["choices"]]
    text = next(t for t in words if len(t.split()) >= 2)  # a reply of two words or more among eight samples
    index = words.index(text)
    cut = _chat(url, n=8, max_tokens=6, seed=1, stop=[text.split()[1]]).json()["choices"][index]
    assert cut["finish_reason"] == "stop" and cut["message"]["content"] == text[:text.find(text.split()[1])]


def test_completions_take_a_list_of_prompts(served):
    url, _ = served
    reply = httpx.post(f"{url}/completions", json={"model": "tiny", "prompt": ["3+4 =", "1+1 ="], "max_tokens": 3},
                       headers=AUTH, timeout=60).json()
    assert reply["object"] == "text_completion" and len(reply["choices"]) == 2
    assert all(isinstance(c["text"], str) for c in reply["choices"])
    models = httpx.get(f"{url}/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


@pytest.mark.parametrize("body, status, param", [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({"temperature": 5}, 400, "temperature"),
    ({"n": 0}, 400, "n"),
    ({"max_tokens": 1.5}, 400, "max_tokens"),
    ({"max_tokens": 10 ** 6}, 400, "max_tokens"),  # over the model's context length
    ({"stream": "yes"}, 400, "stream"),
    ({"top_logprobs": 2}, 400, "top_logprobs"),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),  # without stream: true
    ({"stop": [""]}, 400, "stop"),
    ({"model": "gpt-4o"}, 404, "model"),
])
def test_bad_requests_name_the_key(served, body, status, param):
    url, _ = served
    reply = _chat(url, **body)
    assert reply.status_code == status
    assert reply.json()["error"]["param"] == param


def test_api_key_is_required(served):
    url, _ = served
    body = {"model": "tiny", "messages": [{"role": "user", "content": "1+1"}]}
    assert httpx.post(f"{url}/chat/completions", json=body).status_code == 401
    assert httpx.post(f"{url}/chat/completions", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(f"{url}/models").status_code == 401


def test_judge_client_talks_to_the_server(served):
    """The tiny model is no judge: its replies are graded or counted unparseable, never transport failures."""
    url, _ = served
    judge = JudgeClient(url=url, model="tiny", api_key=KEY, timeout_s=60, max_retries=0, max_concurrency=2,
                        max_tokens=8)  # the tiny model's context is short
    results = judge.score_batch([JudgeItem("correctness", question=f"{a}+{a}", reference=str(2 * a), response="4")
                                 for a in range(4)])
    assert all(r.score is not None or r.error == "unparseable" for r in results), [r.error for r in results]
    assert judge.metrics()["judge/requests"] == 4


# ---- the service layer under `serve model` (rl360/service/app.py) ----

def _start_model(model_dir, *options):
    argv = service_command("model", "--model", str(model_dir), "--port", "0", "--served-model-name", "tiny",
                           "--api-key-env", "RL360_TEST_SERVE_KEY", *options)
    return start_service(argv, env={**os.environ, "RL360_TEST_SERVE_KEY": KEY}, timeout_s=120)


@pytest.fixture(scope="module")
def crowded(served):
    """A second server on the same model taking at most 4 requests at once."""
    proc, url = _start_model(served[1], "--max-in-flight", "4")
    yield proc, url.removesuffix("/v1")
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.parametrize("raw, status, param, said", [
    (b'{"model": "tiny", "messages": [', 400, None, "line 1 column 32"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "1"}], "temprature": 0}', 400, "temprature",
     "unknown field 'temprature'"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "1"}], "temperature": "0"}', 400, "temperature",
     "must be a number"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "1"}], "logprobs": 1}', 400, "logprobs",
     "must be a boolean"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "1"}], "presence_penalty": 2.5}', 400,
     "presence_penalty", "must be in [-2, 2]"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "1"}], "repetition_penalty": 0}', 400,
     "repetition_penalty", "must be in (0, 2]"),
    (b'{"model": "tiny", "messages": "hi"}', 400, "messages", "non-empty list"),
    (b'{"model": 3, "messages": []}', 400, "model", "must be a string"),
])
def test_malformed_json_unknown_fields_and_wrong_types_name_the_field(served, raw, status, param, said):
    url, _ = served
    reply = httpx.post(f"{url}/chat/completions", content=raw, headers=AUTH, timeout=60)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["param"] == param and said in error["message"] and error["type"] == "invalid_request_error"


def test_neutral_openai_keys_are_accepted_and_health_and_metrics_answer(served):
    url, _ = served
    generated = metric_total(url.removesuffix("/v1"), "rl360_model_generations_total", AUTH)
    reply = _chat(url, max_tokens=2, frequency_penalty=0.0, presence_penalty=0, logprobs=False, user="judge",
                  response_format={"type": "text"}, tools=[], stream=False)
    assert reply.status_code == 200 and reply.json()["object"] == "chat.completion"
    base = url.removesuffix("/v1")
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    assert httpx.get(f"{base}/metrics").status_code == 401
    assert metric_total(base, "rl360_model_generations_total", AUTH) == generated + 1
    unauthorized = httpx.post(f"{url}/chat/completions", json={"model": "tiny", "messages": []},
                              headers={"Authorization": "Bearer wrong"})
    assert unauthorized.json()["error"]["type"] == "authentication_error"
    assert metric_total(base, "rl360_model_generations_total", AUTH) == generated + 1  # nothing ran for it


@pytest.mark.timeout(120)
def test_a_burst_is_answered_200_or_429_with_retry_after_in_bounded_memory(crowded):
    proc, base = crowded
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "3+4"}], "max_tokens": 1}).encode()
    route = "/v1/chat/completions"
    before = {status: metric_total(base, "rl360_http_requests_total", AUTH, route=route, status=str(status))
              for status in (200, 429)}
    memory = MemorySampler(proc.pid).start()
    report = burst(f"{base}{route}", requests=300, clients=32, body=body, headers=AUTH,
                   request_timeout_s=60, time_limit_s=90)
    memory.stop()
    assert report.sent == 300 and report.answered == 300 and not report.failures, report.summary()
    assert set(report.statuses) <= {200, 429} and report.statuses[429] > 0, report.summary()
    for status in (200, 429):  # every reply the clients saw is one the service counted, and no more
        answered = metric_total(base, "rl360_http_requests_total", AUTH, route=route, status=str(status))
        assert answered == before[status] + report.statuses[status], (status, report.summary())
    assert metric_total(base, "rl360_http_requests_in_flight", AUTH) == 0
    assert report.missing_retry_after == 0
    assert memory.peak_rss - memory.start_rss < 96 << 20, (memory.start_rss, memory.peak_rss)


@pytest.mark.timeout(180)
def test_sigterm_during_generation_ends_requests_and_a_restart_answers(served):
    grace = 3.0
    proc, url = _start_model(served[1], "--max-in-flight", "16", "--shutdown-grace", str(grace), "--max-batch-rows",
                             "16")
    try:  # sixteen greedy 16 x 240-token generations, about half a second each, one batch each
        body = {"model": "tiny", "messages": [{"role": "user", "content": "3+4"}], "max_tokens": 240, "n": 16,
                "temperature": 0}
        with ThreadPoolExecutor(16) as threads:
            replies = [threads.submit(httpx.post, f"{url}/chat/completions", json=body, headers=AUTH, timeout=60)
                       for _ in range(16)]
            base = url.removesuffix("/v1")
            ends = time.monotonic() + 30
            while metric_total(base, "rl360_http_requests_in_flight", AUTH) < 16 and time.monotonic() < ends:
                time.sleep(0.05)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=grace + 30)
            exited_after = time.monotonic() - signalled
            replies = [future.result() for future in replies]
        assert exited_after <= grace + 0.5, exited_after
        for reply in replies:
            assert reply.status_code in (200, 503), reply.text
            if reply.status_code == 503:
                assert reply.json()["error"]["message"] == "cancelled: service shutting down"
        assert any(reply.status_code == 503 for reply in replies)  # those still waiting for the engine
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    proc, url = _start_model(served[1])
    try:
        assert _chat(url, max_tokens=2).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
