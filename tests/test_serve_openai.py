"""`rl360 serve model` through the `openai` Python package: streamed replies, per-token log-probs and their top
alternatives, concurrent requests decoded in shared batches, and a client hanging up mid-stream."""

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl360.data import PromptRenderer
from rl360.quickstart.assets import build_quickstart_model
from rl360.serve.loadgen import metric_total, service_command, start_service
from rl360.serve.openai_choices import special_ids

KEY = "sk-openai-test-key-77"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUESTION = [{"role": "user", "content": "3+4"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server that waits 100 ms for requests to batch together, its base URL, client and model directory."""
    model_dir = build_quickstart_model(tmp_path_factory.mktemp("openai") / "model")
    argv = service_command("model", "--model", str(model_dir), "--port", "0", "--served-model-name", "tiny",
                           "--api-key-env", "RL360_TEST_OPENAI_KEY", "--batch-window-ms", "100")
    proc, url = start_service(argv, env={**os.environ, "RL360_TEST_OPENAI_KEY": KEY}, timeout_s=120)
    yield url.removesuffix("/v1"), openai.OpenAI(base_url=url, api_key=KEY, max_retries=0), model_dir
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def reference(served):
    """The checkpoint under transformers, its tokenizer, and each token's id by its text."""
    model_dir = served[2]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = {tokenizer.decode([i]): i for i in range(len(tokenizer))}
    assert len(ids) == len(tokenizer)  # every token has its own text
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), tokenizer, ids


def _streamed(chunks):
    """Per choice index: the text, the finish reason, and the chunks' log-prob entries, from a stream; and the usage."""
    texts, reasons, logprobs, usage = {}, {}, {}, None
    for chunk in chunks:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for choice in chunk.choices:
            assert choice.index not in reasons  # nothing after a choice's finish reason
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.logprobs is not None:
                logprobs.setdefault(choice.index, []).append(choice.logprobs)
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, logprobs, usage


def test_chat_stream_equals_the_whole_reply(served):
    _, client, _ = served
    for stop in (None, ["\\boxed"]):
        whole = client.chat.completions.create(model="tiny", messages=QUESTION, n=3, max_tokens=12, seed=11,
                                               stop=stop)
        stream = client.chat.completions.create(model="tiny", messages=QUESTION, n=3, max_tokens=12, seed=11,
                                                stop=stop, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert [c.choices[0].delta.role for c in chunks[:3]] == ["assistant"] * 3  # each choice opens with its role
        assert {c.choices[0].index for c in chunks[:3]} == {0, 1, 2}
        texts, reasons, _, usage = _streamed(chunks)
        assert texts == {c.index: c.message.content for c in whole.choices}
        assert reasons == {c.index: c.finish_reason for c in whole.choices}
        assert usage == whole.usage
        assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    assert any(r == "stop" for r in reasons.values())  # the stop string cut some choice


def test_completions_stream_equals_the_whole_reply_and_ends_with_done(served):
    base, client, _ = served
    body = {"model": "tiny", "prompt": ["3+4 =", "1+1 ="], "n": 2, "max_tokens": 10, "seed": 4, "logprobs": 3}
    whole = client.completions.create(**body)
    texts, reasons, logprobs, usage = _streamed(client.completions.create(**body, stream=True))
    assert texts == {c.index: c.text for c in whole.choices} and sorted(texts) == [0, 1, 2, 3]
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    for choice in whole.choices:  # the chunks' log-probs, put together, are the whole reply's
        pieces = logprobs[choice.index]
        assert sum((p.tokens for p in pieces), []) == choice.logprobs.tokens
        assert sum((p.token_logprobs for p in pieces), []) == choice.logprobs.token_logprobs
        assert sum((p.text_offset for p in pieces), []) == choice.logprobs.text_offset
    assert usage is None  # only with stream_options.include_usage
    raw = httpx.post(f"{base}/v1/completions", json={**body, "stream": True}, headers=AUTH, timeout=60)
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = raw.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])


def _forward_logprobs(model, ids: list[int], prompt_length: int) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[prompt_length - 1:-1]  # row t: the distribution of response token t


def _next_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)


def _with_left_out_specials(listed: list[tuple[int, float]], specials: list[int], next_logprobs):
    """The response's tokens up to its last listed one, and each listed token's position among them: the listing
    leaves special tokens out (they are not in the text), so where the next listed token's log-prob is not the
    model's there (`next_logprobs(tokens so far)`), a special token was drawn first; which one is found by
    trying each (a log-prob matches by chance never)."""
    def search(sequence: list[int], at: int, left: int):
        if at == len(listed):
            return sequence, []
        token, logprob = listed[at]
        if abs(float(next_logprobs(sequence)[token]) - logprob) < 1e-5:
            found = search(sequence + [token], at + 1, left)
            if found is not None:
                return found[0], [len(sequence), *found[1]]
        for special in specials if left else []:
            found = search(sequence + [special], at, left - 1)
            if found is not None:
                return found
        return None

    found = search([], 0, 4)
    assert found is not None, "the listed tokens are not the model's draws, even with special tokens between"
    return found


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_chat_logprobs_are_the_models_log_softmax(served, reference, temperature):
    _, client, _ = served
    model, tokenizer, ids = reference
    k = 20
    reply = client.chat.completions.create(model="tiny", messages=QUESTION, n=2, max_tokens=16, seed=3,
                                           temperature=temperature, logprobs=True, top_logprobs=k)
    prompt = PromptRenderer(tokenizer, 1 << 30).render(QUESTION)
    specials = sorted(special_ids(tokenizer) - {tokenizer.eos_token_id})
    for choice in reply.choices:
        content = choice.logprobs.content
        tokens = [ids[entry.token] for entry in content]
        assert not set(tokens) & special_ids(tokenizer)  # the listed tokens join to the text
        assert "".join(entry.token for entry in content) == choice.message.content
        assert tokenizer.decode(tokens, skip_special_tokens=True) == choice.message.content
        sequence, positions = _with_left_out_specials([(t, e.logprob) for t, e in zip(tokens, content)], specials,
                                                      lambda seq: _next_logprobs(model, prompt + seq))
        expected = _forward_logprobs(model, prompt + sequence, len(prompt))[positions]
        for t, entry in enumerate(content):
            assert entry.bytes == list(entry.token.encode())
            assert abs(entry.logprob - float(expected[t, tokens[t]])) < 1e-5
            top = entry.top_logprobs
            assert len(top) == k and [a.logprob for a in top] == sorted((a.logprob for a in top), reverse=True)
            values, best = expected[t].topk(k)
            assert [ids[a.token] for a in top] == best.tolist()
            assert max(abs(a.logprob - float(v)) for a, v in zip(top, values)) < 1e-5
            if entry.logprob >= top[-1].logprob:  # likely enough to be among the k: it is there
                assert entry.token in [a.token for a in top]
            if temperature == 0:
                assert entry.token == top[0].token  # greedy: the most likely token
        assert len(sequence) <= 16  # (special tokens drawn after the last listed one are not rebuilt)


def test_penalties_are_applied_as_openai_and_sglang_define_them(served, reference):
    """presence_penalty and frequency_penalty (OpenAI's keys) and repetition_penalty (SGLang's, through the
    client's extra_body): each token's log-prob is that of the penalised distribution, computed here from a plain
    forward pass; the eval preset qwen_ins's settings are served."""
    from tests.test_hf_engine import _penalised

    _, client, _ = served
    model, tokenizer, ids = reference
    prompt = PromptRenderer(tokenizer, 1 << 30).render(QUESTION)
    for presence, frequency, repetition in [(1.5, 0.0, 1.0), (0.0, 0.8, 1.0), (-0.5, 0.3, 1.6)]:
        reply = client.chat.completions.create(model="tiny", messages=QUESTION, n=2, max_tokens=12, seed=5,
                                               temperature=0.7, top_p=0.8, logprobs=True, presence_penalty=presence,
                                               frequency_penalty=frequency,
                                               extra_body={"repetition_penalty": repetition, "top_k": 20})
        changed = 0
        specials = sorted(special_ids(tokenizer) - {tokenizer.eos_token_id})
        for choice in reply.choices:
            tokens = [ids[entry.token] for entry in choice.logprobs.content]

            def penalised(sequence, presence=presence, frequency=frequency, repetition=repetition):
                with torch.no_grad():
                    logits = model(torch.tensor([prompt + sequence])).logits[0, -1].float()
                return torch.log_softmax(_penalised(logits, prompt, sequence, presence, frequency, repetition) / 0.7,
                                         -1)

            # every listed log-prob is the penalised distribution's (the search checks each, specials between)
            sequence, positions = _with_left_out_specials(
                [(t, e.logprob) for t, e in zip(tokens, choice.logprobs.content)], specials, penalised)
            with torch.no_grad():
                logits = model(torch.tensor([prompt + sequence])).logits[0, len(prompt) - 1:].float()
            for t, position in enumerate(positions):
                expected = float(penalised(sequence[:position])[tokens[t]])
                changed += abs(float(torch.log_softmax(logits[position] / 0.7, -1)[tokens[t]]) - expected) > 1e-3
        assert changed, (presence, frequency, repetition)


def test_completion_logprobs_in_the_legacy_shape(served, reference):
    _, client, _ = served
    model, tokenizer, ids = reference
    reply = client.completions.create(model="tiny", prompt="3+4 =", max_tokens=12, seed=8, logprobs=5)
    choice = reply.choices[0]
    lp = choice.logprobs
    tokens = [ids[t] for t in lp.tokens]
    prompt = tokenizer("3+4 =")["input_ids"]
    specials = sorted(special_ids(tokenizer) - {tokenizer.eos_token_id})
    _with_left_out_specials(list(zip(tokens, lp.token_logprobs)), specials,  # each log-prob the model's
                            lambda seq: _next_logprobs(model, prompt + seq))
    ends = lp.text_offset[1:] + [len(choice.text)]
    for token, start, end, top, sampled in zip(lp.tokens, lp.text_offset, ends, lp.top_logprobs, lp.token_logprobs):
        assert choice.text[start:end] == tokenizer.decode([ids[token]], skip_special_tokens=True)
        assert top[token] == sampled and 5 <= len(top) <= 6  # the five most likely, and the sampled token


def test_concurrent_requests_share_batches_and_equal_their_solo_answers(served):
    base, client, _ = served
    bodies = [{"model": "tiny", "prompt": f"{i}+{i} =", "max_tokens": 8, "seed": 100 + i, "n": 1 + i % 3}
              for i in range(8)]
    batches = metric_total(base, "rl360_model_batches_total", AUTH)
    together = threading.Barrier(8)

    def send(body):
        together.wait()
        return client.completions.create(**body)

    with ThreadPoolExecutor(8) as threads:
        replies = list(threads.map(send, bodies))
    used = metric_total(base, "rl360_model_batches_total", AUTH) - batches
    assert 1 <= used < 8, used
    for body, reply in zip(bodies, replies):
        solo = client.completions.create(**body)
        assert [c.text for c in reply.choices] == [c.text for c in solo.choices]
        assert [c.finish_reason for c in reply.choices] == [c.finish_reason for c in solo.choices]


def test_a_client_leaving_mid_stream_stops_its_decoding_and_frees_its_slot(served):
    base, client, _ = served
    prompts = [[{"role": "user", "content": f"{a}+{b}"}] for a in range(4) for b in range(4)]
    long = next(p for p in prompts  # a prompt whose greedy reply runs to the length limit
                if client.chat.completions.create(model="tiny", messages=p, temperature=0,
                                                  max_tokens=200).choices[0].finish_reason == "length")
    aborted = metric_total(base, "rl360_model_responses_total", AUTH) - _finished(base)
    written = _completion_tokens(base)
    stream = client.chat.completions.create(model="tiny", messages=long, temperature=0, max_tokens=200, n=16,
                                            stream=True)
    for chunk in stream:
        if chunk.choices[0].delta.content:  # the first text: decoding is under way
            break
    stream.close()
    while metric_total(base, "rl360_model_requests_running", AUTH) or \
            metric_total(base, "rl360_model_requests_queued", AUTH):
        threading.Event().wait(0.05)
    assert metric_total(base, "rl360_model_responses_total", AUTH) - _finished(base) == aborted + 16
    assert _completion_tokens(base) - written < 16 * 200  # stopped before the length limit
    assert metric_total(base, "rl360_http_requests_in_flight", AUTH) <= 1  # this scrape only
    reply = client.chat.completions.create(model="tiny", messages=long, temperature=0, max_tokens=4)
    assert reply.choices[0].finish_reason == "length"


def _finished(base: str) -> float:
    text = httpx.get(f"{base}/metrics", headers=AUTH, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("rl360_model_responses_total{") and 'reason="abort"' not in line)


def _completion_tokens(base: str) -> float:
    text = httpx.get(f"{base}/metrics", headers=AUTH, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("rl360_model_tokens_total{") and 'kind="completion"' in line)


def _trained_tokenizer(kind: str):
    """A small BPE tokenizer trained here: byte-level (GPT-2/Qwen style) or with word-start markers (SentencePiece
    style)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token=None if kind == "bytes" else "<unk>"))
    if kind == "bytes":
        core.pre_tokenizer, core.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        core.pre_tokenizer, core.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|end|>", "<unk>"], initial_alphabet=alphabet)
    core.train_from_iterator([TEXT] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|end|>", unk_token="<unk>")


TEXT = "Hello wörld, 你好 ✓ 3+4 = \\boxed{7}; the  end.\nNext line: naïve café 🙂 done"


@pytest.mark.parametrize("kind", ["bytes", "metaspace"])
def test_text_grown_token_by_token_is_the_whole_decoding(kind):
    import random

    from rl360.core import SamplingParams
    from rl360.engine.generate_request import Row
    from rl360.serve.openai_choices import ChoiceTracker

    tokenizer = _trained_tokenizer(kind)
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    rng = random.Random(0)
    words = TEXT.split(" ")
    sequences = [tokenizer(TEXT)["input_ids"] + [end]]  # and texts of the same characters in other orders:
    sequences += [tokenizer(" ".join(rng.sample(words, len(words))))["input_ids"] for _ in range(20)]
    sequences += [tokenizer("".join(rng.sample(TEXT, len(TEXT))))["input_ids"] for _ in range(20)]
    if kind == "bytes":  # some tokens hold part of a multi-byte character
        assert any("\ufffd" in tokenizer.decode([t]) for t in sequences[0])
    for ids in sequences:
        row = Row([1], SamplingParams(), 0, "r")
        choice = ChoiceTracker(row, 0, tokenizer, [], {end})
        pieces = []
        for token in ids:  # the engine appends a token, the server looks
            row.tokens.append(token)
            pieces.append(choice.advance())
        row.finish_reason = {"type": "length"}
        pieces.append(choice.advance())
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        assert choice.text == whole and "".join(p.text for p in pieces if p) == whole
        assert choice.offsets[-1] == len(choice.text) and choice.offsets == sorted(choice.offsets)
    if kind == "bytes":  # log-prob entries carry each token's own bytes, which put together are the text's
        from rl360.serve.openai_choices import LogprobFormat

        ids = tokenizer(TEXT)["input_ids"]
        row = Row([1], SamplingParams(), 0, "r", tokens=ids, logprobs=[0.0] * len(ids))
        entries = LogprobFormat(tokenizer).chat(row, range(len(ids)))
        assert bytes(sum((e["bytes"] for e in entries), [])) == TEXT.encode()
    stop = TEXT[20:26]  # a stop string across token boundaries: the text ends before it, decoding stops there
    row = Row([1], SamplingParams(), 0, "r")
    choice = ChoiceTracker(row, 0, tokenizer, [stop], {end})
    for token in tokenizer(TEXT)["input_ids"]:
        row.tokens.append(token)
        choice.advance()
    assert choice.text == TEXT[:20] and choice.finish_reason == "stop" and row.aborted is not None


class _Watched(list):
    """A row's token list that records, at each append, whether the token's log-probs were already there."""

    def __init__(self, row):
        super().__init__()
        self.row, self.ready = row, []

    def append(self, token):
        i = len(self)
        self.ready.append(len(self.row.logprobs) > i and len(self.row.top) > i)
        super().append(token)


def test_a_token_is_published_after_its_logprobs(served):
    """A stream reads a row's tokens on the event loop while the decoder appends on its own thread: a token
    must appear only once its log-probs and alternatives are stored, or a reader indexes past them."""
    from rl360.core import SamplingParams
    from rl360.engine.batching import BatchDecoder
    from rl360.engine.generate_request import Row
    from rl360.engine.hf_engine import HFEngine

    engine = HFEngine(str(served[2]), dtype=torch.float32)
    resume = threading.Event()
    resume.set()
    rows = [Row([5, 6, 7], SamplingParams(n=1, max_new_tokens=6), seed=s, rid="r", top_logprobs=2) for s in (1, 2)]
    for row in rows:
        row.tokens = _Watched(row)
    BatchDecoder(engine, threading.Lock(), resume, lambda: "0", []).decode(rows)
    assert all(row.tokens.ready == [True] * 6 for row in rows)


def test_without_max_tokens_a_reply_may_use_the_rest_of_the_context(served, reference):
    """OpenAI's default: no `max_tokens` means up to the model's context length (not a fixed 256, which a small
    context would refuse)."""
    _, client, _ = served
    model, tokenizer, _ = reference
    context = model.config.max_position_embeddings
    prompt = PromptRenderer(tokenizer, 1 << 30).render(QUESTION)
    reply = client.chat.completions.create(model="tiny", messages=QUESTION, seed=2, temperature=1.0)
    assert reply.usage.prompt_tokens == len(prompt)
    assert 1 <= reply.usage.completion_tokens <= context - len(prompt)
    assert reply.choices[0].finish_reason == "stop" or reply.usage.completion_tokens == context - len(prompt)
