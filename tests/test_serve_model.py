"""`rl360 serve model` (a real server process on the quickstart model) answering the OpenAI API, and the
LLM-judge client talking to it."""

import os
import subprocess
import sys

import httpx
import pytest
from transformers import AutoTokenizer

from rl360.data import PromptRenderer
from rl360.quickstart.assets import build_quickstart_model
from rl360.rewards.judge import JudgeClient, JudgeItem

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
    ({"stream": True}, 400, "stream"),
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
