"""The embedded HF engine: sampling, stop tokens, log-probs, and weight updates by HF name."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl360.core import SamplingParams
from rl360.engine.hf_engine import HFEngine
from tests.helpers import make_tiny_qwen2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen2(str(tmp_path_factory.mktemp("tiny")), tie_word_embeddings=False, seed=1)


def test_logprobs_are_those_of_a_plain_forward_pass(model_dir):
    engine = HFEngine(model_dir)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]  # different lengths: left padding
    groups = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=6, temperature=0.7, seed=3))
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert [len(g) for g in groups] == [3, 3, 3]
    for prompt, group in zip(prompts, groups):
        for sample in group:
            assert sample.prompt_ids == prompt
            assert len(sample.response_ids) == len(sample.logprobs) == 6
            ids = torch.tensor([prompt + sample.response_ids])
            with torch.no_grad():
                logits = reference(ids).logits[0, len(prompt) - 1:-1] / 0.7
            expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(sample.response_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-5, rtol=0)


def test_stop_tokens_end_a_response_and_seed_makes_it_repeatable(model_dir):
    engine = HFEngine(model_dir)
    params = SamplingParams(n=8, max_new_tokens=12, seed=11, stop_token_ids=list(range(0, 100, 3)))
    first = engine.generate([[4, 5, 6]], params)[0]
    again = engine.generate([[4, 5, 6]], params)[0]
    assert [s.response_ids for s in first] == [s.response_ids for s in again]
    for sample in first:
        stops = [i for i, t in enumerate(sample.response_ids) if t % 3 == 0]
        if sample.finish_reason == "stop":
            assert stops == [len(sample.response_ids) - 1]
        else:
            assert not stops and len(sample.response_ids) == 12
    assert any(s.finish_reason == "stop" for s in first)


def test_top_k_one_is_greedy(model_dir):
    engine = HFEngine(model_dir)
    samples = engine.generate([[7, 8, 9]], SamplingParams(n=4, top_k=1, max_new_tokens=5, seed=0))[0]
    assert len({tuple(s.response_ids) for s in samples}) == 1


def test_temperature_zero_decodes_the_argmax_with_plain_logprobs(model_dir):
    """Greedy decoding (ReMax's baseline rollouts): every token is the argmax of a plain forward pass over
    the prompt and the tokens so far, whatever the seed, and its log-prob is that of temperature 1."""
    engine = HFEngine(model_dir)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]  # different lengths: left padding
    groups = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=6, seed=3))
    reseeded = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=6, seed=99))
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for prompt, group, other in zip(prompts, groups, reseeded):
        assert group[0].response_ids == group[1].response_ids == other[0].response_ids
        ids = torch.tensor([prompt + group[0].response_ids])
        with torch.no_grad():
            logits = reference(ids).logits[0, len(prompt) - 1:-1]
        assert group[0].response_ids == logits.argmax(-1).tolist()
        expected = torch.log_softmax(logits, -1).max(-1).values
        torch.testing.assert_close(torch.tensor(group[0].logprobs), expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(prompts, SamplingParams(temperature=-1.0))


def test_weight_update_by_hf_name_changes_outputs_and_checks_completeness(model_dir):
    engine = HFEngine(model_dir)
    donor = AutoModelForCausalLM.from_pretrained(make_tiny_qwen2(model_dir + "_donor", False, seed=2))
    state = donor.state_dict()
    names = list(state)
    engine.update_weights([(n, state[n]) for n in names[: len(names) // 2]], version=1)
    engine.update_weights([(n, state[n]) for n in names[len(names) // 2:]], version=1)
    assert engine.finish_weight_update(1) == 1
    for name, param in engine.model.state_dict().items():
        assert torch.equal(param.cpu(), state[name]), name
    engine.update_weights([(names[0], state[names[0]])], version=2)
    with pytest.raises(RuntimeError, match="left parameters unset"):
        engine.finish_weight_update(2)
    with pytest.raises(KeyError, match="not_a_weight"):
        engine.update_weights([("not_a_weight", torch.zeros(1))], version=2)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([(names[0], torch.zeros(3, 3))], version=2)


def _penalised(logits: torch.Tensor, prompt: list[int], generated: list[int], presence: float = 0.0,
               frequency: float = 0.0, repetition: float = 1.0) -> torch.Tensor:
    """The penalties as OpenAI and SGLang define them, token by token: HF's repetition penalty over the prompt and
    the generated tokens, then the frequency penalty per occurrence and the presence penalty once per generated
    token."""
    out = logits.clone()
    for token in set(prompt) | set(generated):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token in set(generated):
        out[token] -= frequency * generated.count(token) + presence
    return out


def test_penalties_shift_the_sampling_distribution_as_defined(model_dir):
    """Each sampled token's log-prob is that of the penalised distribution computed independently from a plain
    forward pass (the penalties before the temperature); greedy decoding takes the penalised argmax."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-wide model: one thread is fastest, and unaffected by a busy machine
    try:
        _check_penalties(model_dir)
    finally:
        torch.set_num_threads(threads)


def _check_penalties(model_dir):
    engine = HFEngine(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    names = {"presence": "presence_penalty", "frequency": "frequency_penalty", "repetition": "repetition_penalty"}
    prompts = [[5, 6, 5, 7, 5], [10, 11]]
    for penalties in [{"presence": 1.5}, {"frequency": 0.7}, {"repetition": 1.8},
                      {"presence": -0.5, "frequency": 0.4, "repetition": 1.3}]:
        settings = {names[key]: value for key, value in penalties.items()}
        changed = 0
        for temperature in (0.8, 0.0):
            params = SamplingParams(n=2, max_new_tokens=10, temperature=temperature, seed=4, **settings)
            for prompt, group in zip(prompts, engine.generate(prompts, params)):
                for sample in group:
                    with torch.no_grad():
                        logits = reference(torch.tensor([prompt + sample.response_ids])).logits[0, len(prompt) - 1:-1]
                    for t, token in enumerate(sample.response_ids):
                        shifted = _penalised(logits[t], prompt, sample.response_ids[:t], **penalties)
                        if temperature == 0:
                            assert token == int(shifted.argmax()), (penalties, t)
                        expected = float(torch.log_softmax(shifted / (temperature or 1.0), -1)[token])
                        assert abs(sample.logprobs[t] - expected) < 1e-5, (penalties, t, sample.logprobs[t], expected)
                        plain = float(torch.log_softmax(logits[t] / (temperature or 1.0), -1)[token])
                        changed += abs(plain - expected) > 1e-3
        assert changed, penalties  # the penalties moved the distribution the tokens were drawn from
