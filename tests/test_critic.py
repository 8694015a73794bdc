"""The PPO critic rank in this process: value head, micro-batch invariance of its gradient, learning."""

import pytest
import torch

from rl360.actor.critic import CriticWorker, ValueHead
from rl360.actor.policy import PolicyWorker
from rl360.actor.settings import PolicySettings
from tests.dp_worker import fixed_batch
from tests.helpers import make_tiny_qwen2
from tests.test_policy import _config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen2(str(tmp_path_factory.mktemp("critic")), tie_word_embeddings=True, seed=6)


def _with_targets(batch, values):
    gen = torch.Generator().manual_seed(2)
    batch.values = values + 0.03 * torch.randn(values.shape, generator=gen) * batch.response_mask
    batch.returns = 0.1 * torch.randn(values.shape, generator=gen) * batch.response_mask
    return batch


def test_critic_is_the_policy_body_with_a_zero_value_head(megatron_single_rank, model_dir):
    critic = CriticWorker(PolicySettings.of(_config(model_dir)))
    model = critic.models[0].module
    assert isinstance(model.output_layer, ValueHead) and not model.share_embeddings_and_output_weights
    batch = fixed_batch()
    values = critic.compute_values(batch)
    assert values.shape == batch.response_mask.shape and values.abs().max() == 0  # head starts at zero
    policy_body = dict(PolicyWorker(PolicySettings.of(_config(model_dir))).models[0].module.decoder.named_parameters())
    for name, param in model.decoder.named_parameters():
        assert torch.equal(param, policy_body[name]), name


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_critic_gradient_does_not_depend_on_micro_batch_split(megatron_single_rank, model_dir, mode):
    grads = []
    for micro in (16, 8, 2):  # the critic's own setting (the actor's is 4 throughout)
        critic = CriticWorker(PolicySettings.of(_config(model_dir, "actor.micro_batch_size=4",
                                                        f"critic.micro_batch_size={micro}",
                                                        f"actor.loss_agg_mode={mode}", "critic.cliprange_value=0.02")))
        head = critic.models[0].module.output_layer
        with torch.no_grad():  # a non-zero head, so the body gets a gradient too
            head.weight.copy_(0.05 * torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(0)))
        batch = fixed_batch()
        batch = _with_targets(batch, critic.compute_values(batch))
        reports = critic.accumulate_gradients(batch)
        assert len(reports) == 16 // micro  # one report per micro-batch
        assert sum(r["critic/vf_clipfrac"] for r in reports) > 0  # some values are clipped
        grads.append(torch.cat([p.main_grad.flatten().cpu() for p in critic.models[0].parameters()]))
    assert grads[0].abs().sum() > 0
    for other in grads[1:]:
        assert (other - grads[0]).abs().max().item() <= 1e-6


def test_critic_updates_reduce_the_value_loss(megatron_single_rank, model_dir):
    critic = CriticWorker(PolicySettings.of(_config(model_dir, "critic.lr=1e-2", "critic.cliprange_value=10")))
    batch = fixed_batch()
    batch.returns = torch.full(batch.response_mask.shape, 0.7) * batch.response_mask
    losses = []
    for _ in range(6):
        batch.values = critic.compute_values(batch)
        losses.append(critic.update(batch)["critic/vf_loss"])
    assert losses[-1] < 0.2 * losses[0]
    assert critic.compute_values(batch)[batch.response_mask > 0].mean().item() == pytest.approx(0.7, abs=0.15)


@pytest.mark.parametrize("tp, pp, cp, sp, mode", [(2, 1, 1, 0, "token-mean"), (1, 2, 1, 0, "seq-mean-token-mean"),
                                                  (1, 1, 2, 0, "seq-mean-token-sum"), (2, 1, 1, 1, "token-mean")])
def test_model_parallel_critic_matches_one_rank(megatron_single_rank, model_dir, tmp_path, tp, pp, cp, sp, mode):
    """At TP=2 (value head replicated on both ranks), PP=2 (tied embeddings untied from the head), CP=2 (values
    gathered from both halves of each sequence) and TP=2 with sequence parallelism (hidden states gathered before
    the head): the same values and the same gradient, body and head, as the one-rank critic, with uneven
    micro-batches."""
    _assert_parallel_critic_matches_one_rank(model_dir, tmp_path, mode, tp, pp, cp, sp)


def test_virtual_pipeline_critic_matches_one_rank(megatron_single_rank, tmp_path):
    """PP=2 x VPP=2: the value head on rank 1's second chunk, the embedding on rank 0's first."""
    model_dir = make_tiny_qwen2(str(tmp_path / "hf"), tie_word_embeddings=True, seed=6, num_layers=4)
    _assert_parallel_critic_matches_one_rank(model_dir, tmp_path, "token-mean", 1, 2, vpp=2)


def _assert_parallel_critic_matches_one_rank(model_dir, tmp_path, mode, tp, pp, cp=1, sp=0, vpp=1):
    from safetensors.torch import load_file

    from rl360.cluster.launch import run_ranks
    from tests.critic_parallel_worker import config, values_and_gradient

    expected_values, expected_gradient = values_and_gradient(
        CriticWorker(PolicySettings.of(config(model_dir, mode, 1, 1, 3))))
    world = tp * pp * cp
    run_ranks("tests.critic_parallel_worker:main", world,
              [model_dir, str(tmp_path), mode, str(tp), str(pp), "3", str(cp), str(sp), str(vpp)], timeout_s=600)
    last_stage = list(range(world - tp * cp, world))
    assert [r for r in range(world) if (tmp_path / f"values_rank{r}.pt").exists()] == last_stage
    assert expected_values.abs().max() > 0
    for rank in last_stage:
        torch.testing.assert_close(torch.load(tmp_path / f"values_rank{rank}.pt"), expected_values, atol=1e-5, rtol=0)
    assert all(t.abs().sum() > 0 for name, t in expected_gradient.items() if name.startswith("value_head."))
    assert any(t.abs().sum() > 0 for name, t in expected_gradient.items() if not name.startswith("value_head."))
    for rank in range(world):
        gradient = load_file(tmp_path / f"gradient_rank{rank}.safetensors")
        head = {"value_head.weight", "value_head.bias"} if rank in last_stage else set()
        assert sorted(gradient) == sorted(name for name in expected_gradient
                                          if not name.startswith("value_head.") or name in head)
        for name, tensor in gradient.items():
            assert (tensor - expected_gradient[name]).abs().max().item() <= 1e-6, (rank, name)
