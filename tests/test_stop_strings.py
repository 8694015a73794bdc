"""Stop strings (`SamplingParams.stop`, SGLang's `stop`): the shared matcher over incrementally decoded tokens,
the in-process HF engine, `rl360 serve rollout` as a real process driven by `EngineClient`, and a sample continued
after a cut (a partial rollout) that still ends at a stop string spanning the cut.

The model is the quickstart's random tiny Qwen2 with its word-level tokenizer (each token a word, digit or
character), so a stop string of several tokens is the text of a few sampled tokens."""

import asyncio
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl360.config import ConfigError, load_config
from rl360.core import Sample, SamplingParams
from rl360.core.client import EngineClient, sampling_options
from rl360.engine.hf_engine import HFEngine
from rl360.engine.stop_strings import StopMatcher, first_stop
from rl360.quickstart.assets import build_quickstart_model
from rl360.rollout.fleet import EngineFleet
from tests.helpers import serving_url

KEY = "stop-strings-test-key-0123456789"
NEVER = "§"  # a character no token of the quickstart tokenizer decodes to
PROMPTS = [[1, 5, 12, 13, 6], [1, 5, 14, 3]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_quickstart_model(tmp_path_factory.mktemp("stop") / "model", seed=2))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def text(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False)


def ends_at(tokenizer, ids, stop):
    """The reference: the length of the shortest prefix of `ids` whose text holds `stop` (None: none does)."""
    return next((k for k in range(1, len(ids) + 1) if stop in text(tokenizer, ids[:k])), None)


def stop_of(tokenizer, ids, start, width):
    """A stop string of `width` tokens: the text of ids[start:start + width], none of them special."""
    assert all(not tokenizer.convert_ids_to_tokens(t).startswith("<|") for t in ids[start:start + width]), ids
    return text(tokenizer, ids[start:start + width])


# ---------------------------------------------------------------- the matcher

class CountingTokenizer:
    """The tokenizer, recording the longest token list it was asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.longest = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_the_matcher_stops_at_the_token_completing_a_string_in_a_short_window(tokenizer):
    ids = tokenizer.encode("1+2=3. 4+5=9. " * 40, add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    matcher = StopMatcher(counting, ["=3. 4+5=9. 1+2=3", "9. 1+2"])
    pieces, match = [], None
    for token in ids:
        piece, match = matcher.push(token)
        pieces.append(piece)
        if match is not None:
            break
    # the first string starts earlier but is completed later: the row stops where the second is completed
    assert match is not None and match.string == "9. 1+2" and match.tokens == ends_at(tokenizer, ids, "9. 1+2") == 17
    assert match.start == text(tokenizer, ids).index("9. 1+2") and "".join(pieces) == text(tokenizer, ids[:17])
    # two strings completed by one token: the one starting first
    assert first_stop(ids, tokenizer, ["9.", "=9."]).string == "=9."
    # a long response without a stop: every decode is of a few tokens, not of the response so far
    counting.longest = 0
    assert first_stop(ids, counting, [NEVER]) is None
    matcher = StopMatcher(counting, [NEVER])
    assert "".join(matcher.push(token)[0] for token in ids) == text(tokenizer, ids) and counting.longest <= 3


def test_rollout_stop_takes_non_empty_strings():
    assert load_config("configs/quickstart.yaml", ["rollout.stop=[</answer>]"]).rollout.stop == ["</answer>"]
    with pytest.raises(ConfigError, match=r"rollout.stop=\[''\] has an empty string"):
        load_config("configs/quickstart.yaml", ["rollout.stop=['']"])


# ---------------------------------------------------------------- the HF engine, in process

def test_the_hf_engine_stops_at_a_string_of_several_tokens(model_dir, tokenizer):
    engine = HFEngine(model_dir)
    params = SamplingParams(n=3, max_new_tokens=16, temperature=1.0, seed=5)
    base = [sample for group in engine.generate(PROMPTS, params) for sample in group]
    stop = stop_of(tokenizer, base[0].response_ids, 3, 3)
    stopped = [sample for group in engine.generate(PROMPTS, replace(params, stop=[stop, NEVER])) for sample in group]
    never = [sample for group in engine.generate(PROMPTS, replace(params, stop=[NEVER])) for sample in group]
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    cut = 0
    for prompt, before, after, unchanged in zip([p for p in PROMPTS for _ in range(3)], base, stopped, never):
        assert (unchanged.response_ids, unchanged.logprobs, unchanged.finish_reason) == (
            before.response_ids, before.logprobs, before.finish_reason) and unchanged.stop_matched is None
        k = ends_at(tokenizer, before.response_ids, stop)
        if k is None:
            assert (after.response_ids, after.logprobs, after.stop_matched) == (before.response_ids, before.logprobs,
                                                                                None)
            continue
        cut += 1
        # the tokens sampled up to the one completing the string, with their log-probs; nothing after it
        assert after.response_ids == before.response_ids[:k] and after.logprobs == before.logprobs[:k]
        assert after.finish_reason == "stop" and after.stop_matched == stop
        with torch.no_grad():  # the log-probs are those of a plain forward pass over prompt + stopped response
            logits = reference(torch.tensor([prompt + after.response_ids])).logits[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(after.response_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(after.logprobs), expected, atol=1e-5, rtol=0)
    assert cut >= 1


# ---------------------------------------------------------------- rl360 serve rollout, a real process

@pytest.fixture(scope="module")
def served(model_dir):
    proc = subprocess.Popen([sys.executable, "-m", "rl360.cli", "serve", "rollout", "--model", model_dir, "--port",
                             "0", "--api-key-env", "RL360_TEST_STOP_KEY", "--batch-window-ms", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RL360_TEST_STOP_KEY": KEY})
    yield serving_url(proc)
    proc.terminate()
    proc.communicate(timeout=30)


async def _generate(url, options, prompt=PROMPTS[0]):
    async with EngineClient(url, api_key=KEY, timeout_s=60) as client:
        return (await client.generate([prompt], [options], True))[0]


def test_the_client_sends_stop_strings_in_sglangs_shape():
    assert sampling_options(SamplingParams(max_new_tokens=8, stop_token_ids=[2], stop=["</code>", "\n\n"])) == {
        "n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8, "stop_token_ids": [2],
        "stop": ["</code>", "\n\n"]}
    assert "stop" not in sampling_options(SamplingParams())


def test_serve_rollout_stops_trims_and_names_the_string(served, tokenizer):
    options = {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 9}
    base = asyncio.run(_generate(served, options))
    ids = base["output_ids"]
    stop = stop_of(tokenizer, ids, 4, 2)
    k = ends_at(tokenizer, ids, stop)
    trimmed = asyncio.run(_generate(served, {**options, "stop": stop}))
    kept = asyncio.run(_generate(served, {**options, "stop": [NEVER, stop], "no_stop_trim": True}))
    never = asyncio.run(_generate(served, {**options, "stop": [NEVER]}))
    for reply in (trimmed, kept):
        assert reply["output_ids"] == ids[:k] and reply["meta_info"]["finish_reason"] == {"type": "stop",
                                                                                         "matched": stop}
        assert [entry[0] for entry in reply["meta_info"]["output_token_logprobs"]] == [
            entry[0] for entry in base["meta_info"]["output_token_logprobs"][:k]]
    whole = tokenizer.decode(ids[:k], skip_special_tokens=True)
    assert whole.endswith(stop) and kept["text"] == whole and trimmed["text"] == whole[:whole.index(stop)]
    assert never["output_ids"] == ids and never["text"] == base["text"]
    assert never["meta_info"]["finish_reason"] == base["meta_info"]["finish_reason"]
    # through the client's samples: the string that ended each
    params = SamplingParams(n=2, max_new_tokens=16, temperature=1.0, stop=[stop])

    async def run():
        async with EngineClient(served, api_key=KEY, timeout_s=60) as client:
            return await client.generate_samples([PROMPTS[0]], params, seed=9)

    [[first, second]] = asyncio.run(run())
    assert first.response_ids == ids[:k] and first.stop_matched == stop and first.finish_reason == "stop"
    assert second.stop_matched in (stop, None)


def test_bad_stop_values_are_refused_naming_the_field(served):
    for settings, field in [({"stop": ""}, "stop"), ({"stop": [""]}, "stop"), ({"stop": ["</code>", 3]}, "stop"),
                            ({"stop": 5}, "stop"), ({"stop": {"s": "x"}}, "stop"),
                            ({"no_stop_trim": 1}, "no_stop_trim")]:
        reply = httpx.post(f"{served}/generate", json={"input_ids": [1, 5], "sampling_params": settings},
                           headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == f"sampling_params.{field}", settings


# ---------------------------------------------------------------- a continued sample (partial rollouts)

class ServedEngine:
    """The fleet's `Engine` for an `rl360 serve rollout` process started elsewhere: generate through
    `EngineClient`."""

    kind, index, version, usable, log_path, supports_pause = "server", 0, 0, True, None, True

    def __init__(self, url):
        self.url = url

    async def start(self):
        return self.url

    async def generate(self, prompts, params, seed):
        async with EngineClient(self.url, api_key=KEY, timeout_s=60) as client:
            return await client.generate_samples(prompts, params, seed=seed)

    def describe(self):
        return {"index": self.index, "kind": self.kind, "url": self.url}

    def stop(self):
        return None


def test_a_continued_sample_ends_at_a_stop_string_spanning_its_cut(served, model_dir, tokenizer, tmp_path):
    greedy = {"max_new_tokens": 16, "temperature": 0.0}
    ids = asyncio.run(_generate(served, greedy, PROMPTS[1]))["output_ids"]
    # a two-token string whose first occurrence spans tokens j - 1 and j: the cut falls between them
    j = next(j for j in range(1, len(ids)) if ends_at(tokenizer, ids, stop_of(tokenizer, ids, j - 1, 2)) == j + 1)
    stop = stop_of(tokenizer, ids, j - 1, 2)
    rest = asyncio.run(_generate(served, {**greedy, "stop": [stop]}, PROMPTS[1] + ids[:j]))["output_ids"]
    assert rest[0] == ids[j] and len(rest) > 1  # the engine alone, from the cut, never sees the string whole
    fleet = EngineFleet(SimpleNamespace(router="fleet"), SimpleNamespace(path=model_dir), None, None, Path(tmp_path),
                        engines=[ServedEngine(served)])
    cut = Sample(list(PROMPTS[1]), ids[:j], [-1.0] * j, "abort")

    async def run():
        await fleet.start()
        return await fleet._continue(cut, SamplingParams(max_new_tokens=16, temperature=0.0, stop=[stop]), 0)

    sample = asyncio.run(run())
    assert sample.response_ids == ids[:j + 1] and sample.finish_reason == "stop" and sample.stop_matched == stop
    assert sample.resumed == 1 and sample.logprobs[:j] == [-1.0] * j and len(sample.logprobs) == j + 1
