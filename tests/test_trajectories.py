"""Multi-turn trajectories: tokens a tool inserted stay in the context but are not trained on (`loss_mask` 0),
the score lands on the last generated token, and a single-turn sample builds the batch it always did."""

import pytest
import torch

from rl360.actor.batch import build_batch
from rl360.actor.policy import PolicyWorker
from rl360.actor.settings import PolicySettings
from rl360.algos.advantages import token_rewards
from rl360.core import Sample, SamplingParams, Turn
from rl360.engine.hf_engine import HFEngine
from rl360.rollout.sampler import Scored
from tests.helpers import make_tiny_qwen2

TOOL = [20, 21, 22]  # what a tool "printed" between the turns


def _config(model_dir, *overrides):
    from rl360.config import load_config

    return load_config(None, [f"model.path={model_dir}", "data.train_files=[unused.parquet]", "rollout.n=3",
                              "data.batch_size=1", "actor.ppo_mini_batch_size=1", "actor.micro_batch_size=8",
                              "actor.lr=1e-2", "rollout.temperature=0.9", *overrides])


def _sample(engine, prompt, tokens=4, seed=0):
    params = SamplingParams(n=1, max_new_tokens=tokens, temperature=0.9, seed=seed)
    return engine.generate([prompt], params)[0][0]


def _two_turns(engine, prompt, seed):
    first = _sample(engine, prompt, seed=seed)
    second = _sample(engine, first.continuation() + TOOL, seed=seed + 1)
    return first, second, first.then(TOOL, second)


def test_a_second_turn_after_tool_tokens_is_one_trajectory():
    first = Sample([1, 2], [5, 6, 7], [-0.1, -0.2, -0.3], "stop", weight_version=3)
    second = Sample([1, 2, 5, 6, 7, *TOOL], [8, 9], [-0.4, -0.5], "length", weight_version=4)
    joined = first.then(TOOL, second)
    assert joined.prompt_ids == [1, 2] and joined.response_ids == [5, 6, 7, *TOOL, 8, 9]
    assert joined.logprobs == [-0.1, -0.2, -0.3, 0.0, 0.0, 0.0, -0.4, -0.5]
    assert joined.mask() == [1, 1, 1, 0, 0, 0, 1, 1] and joined.finish_reason == "length"
    assert joined.turn_list() == [Turn(0, 3, 3), Turn(3, 6, 4, generated=False), Turn(6, 8, 4)]
    assert joined.versions() == [3, 3, 3, 4, 4, 4, 4, 4]
    assert first.mask() == [1, 1, 1] and first.turn_list() == [Turn(0, 3, 3)] and first.loss_mask is None
    # a second turn cut by a weight update and continued stays one turn; the mask goes on
    cut = Sample([1, 2], [8], [-0.4], "abort", weight_version=4)
    resumed = first.then(TOOL, cut).continued(Sample([1, 2, 5, 6, 7, *TOOL, 8], [9], [-0.6], "stop", 5))
    assert resumed.mask() == [1, 1, 1, 0, 0, 0, 1, 1] and resumed.versions()[-2:] == [4, 5]
    assert resumed.turn_list() == [Turn(0, 3, 3), Turn(3, 6, 4, generated=False), Turn(6, 8, 4)]


def test_single_turn_samples_build_the_batch_they_always_did():
    samples = [Sample([3, 4, 5], [6, 7], [-0.5, -0.25], "stop"), Sample([8], [9, 10, 11, 12], [-1.0] * 4, "length"),
               Sample([13, 14], [], [], "abort")]
    scored = Scored([{}] * 3, samples, torch.zeros(3), torch.zeros(3), 1)
    new = scored.batch(pad_id=0)
    old = build_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                      [s.logprobs for s in samples], pad_id=0)
    for name in ("input_ids", "response_start", "response_ids", "response_mask", "rollout_logprobs"):
        assert torch.equal(getattr(new, name), getattr(old, name)), name
    rewards = token_rewards(torch.tensor([1.0, 2.0, 3.0]), new.response_mask)
    assert rewards.nonzero().tolist() == [[0, 1], [1, 3], [2, 0]]


def test_the_score_lands_on_the_last_generated_token():
    ends_in_tool = Sample([1], [5, 6], [-0.1, -0.2], "stop").then(TOOL, Sample([1, 5, 6, *TOOL], [], [], "abort"))
    two_turns = Sample([1], [5], [-0.1], "stop").then(TOOL, Sample([1, 5, *TOOL], [7, 8], [-0.3, -0.4], "stop"))
    samples = [ends_in_tool, two_turns]
    batch = build_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                        [s.logprobs for s in samples], loss_masks=[s.loss_mask for s in samples])
    assert batch.response_mask.tolist() == [[1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 1, 1]]
    assert batch.input_ids[0, 1:6].tolist() == [5, 6, *TOOL]  # the tool's tokens stay in the context
    rewards = token_rewards(torch.tensor([2.0, 3.0]), batch.response_mask)
    assert rewards.nonzero().tolist() == [[0, 1], [1, 5]] and rewards[rewards != 0].tolist() == [2.0, 3.0]
    with pytest.raises(ValueError, match="sample 0: a loss mask of 1 tokens for a response of 2"):
        build_batch([[1]], [[5, 6]], [[0.0, 0.0]], loss_masks=[[1]])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen2(str(tmp_path_factory.mktemp("trajectories")), tie_word_embeddings=True, seed=4)


def test_tool_tokens_add_nothing_to_the_policy_gradient(megatron_single_rank, model_dir):
    """Through the real actor (clipped loss, entropy bonus, KL loss to a reference, truncated importance
    sampling): whatever the tool tokens' advantages and log-probs, the gradient is bit for bit the same; the same
    change on generated tokens moves it. The trainer's log-probs of the second turn, which the engine sampled
    after the tool's tokens, match the engine's: the tool tokens are the policy's context."""
    engine = HFEngine(model_dir)
    trajectories = [_two_turns(engine, prompt, seed) for seed, prompt in enumerate([[3, 4, 5, 6], [7, 8, 9]])]
    samples = [joined for _, _, joined in trajectories] + [_sample(engine, [12, 13], seed=9)]
    batch = build_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                        [s.logprobs for s in samples], loss_masks=[s.loss_mask for s in samples])
    tool = torch.zeros_like(batch.response_mask, dtype=torch.bool)
    for row, (first, _, _) in enumerate(trajectories):
        tool[row, len(first.response_ids):len(first.response_ids) + len(TOOL)] = True
    assert batch.response_mask[tool].sum() == 0 and batch.response_mask.sum() == 2 * (4 + 4) + 4

    overrides = ("actor.entropy_coeff=0.01", "algorithm.kl_coef=0.1", "actor.rollout_correction=tis",
                 "actor.rollout_is_threshold=2.0", "actor.clip_ratio_c=3")
    worker = PolicyWorker(PolicySettings.of(_config(model_dir, *overrides)))
    logprobs = worker.compute_logprobs(batch)
    assert ((logprobs - batch.rollout_logprobs).abs() * batch.response_mask).max().item() <= 1e-5
    batch.old_logprobs = logprobs - 0.05
    batch.ref_logprobs = worker.compute_logprobs(batch, reference=True)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    batch.advantages *= batch.response_mask

    def gradient(rows_changed: torch.Tensor) -> torch.Tensor:
        changed = batch.select(slice(None))
        noise = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(1)) * rows_changed
        changed.advantages = batch.advantages + 5 * noise
        changed.old_logprobs = batch.old_logprobs + noise
        changed.rollout_logprobs = batch.rollout_logprobs - noise
        changed.ref_logprobs = batch.ref_logprobs + noise
        fresh = PolicyWorker(PolicySettings.of(_config(model_dir, *overrides)))
        fresh.accumulate_gradients(changed)
        return torch.cat([p.main_grad.flatten().cpu() for p in fresh.models[0].parameters()])

    plain = gradient(torch.zeros_like(tool))
    assert plain.abs().sum() > 0
    assert torch.equal(gradient(tool), plain)
    generated = batch.response_mask.bool() & ~tool
    assert (gradient(generated) - plain).abs().max() > 1e-4
