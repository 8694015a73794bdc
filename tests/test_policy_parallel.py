"""The Megatron policy at TP=2 and PP=2 (gloo processes) against the same policy in one process: the same
log-probs and the same gradient, for each loss aggregation, with uneven micro-batches, padded or packed."""

import pytest
import torch
from safetensors.torch import load_file

from rl360.actor.policy import PolicyWorker
from rl360.actor.settings import PolicySettings
from rl360.cluster.launch import run_ranks
from tests.helpers import make_tiny_qwen2
from tests.policy_parallel_worker import config, logprobs_and_gradient


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen2(str(tmp_path_factory.mktemp("policy_tp")), tie_word_embeddings=True, seed=5)


@pytest.fixture(scope="module")
def four_layer_model_dir(tmp_path_factory):
    return make_tiny_qwen2(str(tmp_path_factory.mktemp("policy_vpp")), tie_word_embeddings=True, seed=6,
                           num_layers=4)


PACKED = "actor.pack_sequences=true"


@pytest.mark.parametrize("tp, pp, mode, extra", [
    (2, 1, "token-mean", ""), (1, 2, "seq-mean-token-sum-norm", ""), (2, 1, "seq-mean-token-mean", ""),
    (1, 2, "token-mean", ""),
    # packed sequences (one row per micro-batch, no padding) against the padded one-rank policy
    (2, 1, "seq-mean-token-mean", PACKED), (1, 2, "token-mean", f"{PACKED} actor.max_tokens_per_micro_batch=24"),
])
def test_model_parallel_policy_matches_one_rank(megatron_single_rank, model_dir, tmp_path, tp, pp, mode, extra):
    micro = 3  # 16 samples in micro-batches of 3: the last one is smaller, and widths differ
    expected_logprobs, expected_gradient = logprobs_and_gradient(
        PolicyWorker(PolicySettings.of(config(model_dir, mode, 1, 1, micro))))
    run_ranks("tests.policy_parallel_worker:main", tp * pp, [model_dir, str(tmp_path), mode, str(tp), str(pp),
                                                             str(micro), extra], timeout_s=600)
    returning = [rank for rank in range(tp * pp) if (tmp_path / f"logprobs_rank{rank}.pt").exists()]
    assert returning == list(range(tp * pp - tp, tp * pp))  # the last stage's ranks hold the log-probs
    for rank in returning:
        torch.testing.assert_close(torch.load(tmp_path / f"logprobs_rank{rank}.pt"), expected_logprobs,
                                   atol=1e-5, rtol=0)
    assert any(t.abs().sum() > 0 for t in expected_gradient.values())
    for rank in range(tp * pp):
        gradient = load_file(tmp_path / f"gradient_rank{rank}.safetensors")
        assert sorted(gradient) == sorted(expected_gradient)
        for name, tensor in expected_gradient.items():
            assert (gradient[name] - tensor).abs().max().item() <= 1e-6, (rank, name)


@pytest.mark.parametrize("tp, pp, cp, mode, extra", [
    (1, 1, 2, "token-mean", ""),  # padded rows, each split in 4 chunks over 2 ranks
    (1, 1, 2, "seq-mean-token-mean", PACKED),  # each packed sequence padded to a multiple of 4 and split
    (2, 2, 2, "token-mean", f"{PACKED} actor.max_tokens_per_micro_batch=24"),
    # sequence parallelism: tokens split over the tensor-parallel ranks outside the attention and MLP blocks
    (2, 1, 1, "seq-mean-token-sum", "actor.parallel.sequence=true"),
    (2, 2, 2, "token-mean", f"{PACKED} actor.parallel.sequence=true"),
])
def test_context_and_sequence_parallel_policy_matches_one_rank(megatron_single_rank, model_dir, tmp_path, tp, pp, cp,
                                                              mode, extra):
    """Context and sequence parallelism (with TP and PP, padded or packed) against the padded one-rank policy."""
    # sequence parallelism sums the tied embedding's gradient in another order (measured: 1.5e-6 apart)
    atol = 2e-6 if "sequence=true" in extra else 1e-6
    micro = 3
    expected_logprobs, expected_gradient = logprobs_and_gradient(
        PolicyWorker(PolicySettings.of(config(model_dir, mode, 1, 1, micro))))
    world = tp * pp * cp
    run_ranks("tests.policy_parallel_worker:main", world, [model_dir, str(tmp_path), mode, str(tp), str(pp),
                                                           str(micro), f"actor.parallel.context={cp} {extra}"],
              timeout_s=900)
    last_stage = list(range(world - tp * cp, world))  # megatron orders ranks TP fastest, then CP, ..., PP last
    assert [rank for rank in range(world) if (tmp_path / f"logprobs_rank{rank}.pt").exists()] == last_stage
    for rank in last_stage:
        torch.testing.assert_close(torch.load(tmp_path / f"logprobs_rank{rank}.pt"), expected_logprobs,
                                   atol=1e-5, rtol=0)
    for rank in range(world):
        gradient = load_file(tmp_path / f"gradient_rank{rank}.safetensors")
        assert sorted(gradient) == sorted(expected_gradient)
        for name, tensor in expected_gradient.items():
            assert (gradient[name] - tensor).abs().max().item() <= atol, (rank, name)


@pytest.mark.parametrize("tp, pp, vpp, mode, micro, extra", [
    (1, 2, 2, "token-mean", 3, ""),  # 6 micro-batches of uneven size and width
    (1, 2, 2, "seq-mean-token-mean", 16, ""),  # one micro-batch of 16 rows: split in two for the two stages
    (1, 2, 2, "seq-mean-token-sum-norm", 3, f"{PACKED} actor.max_tokens_per_micro_batch=40"),
    (2, 2, 2, "token-mean", 3, f"{PACKED} actor.parallel.sequence=true"),
])
def test_virtual_pipeline_policy_matches_one_rank(megatron_single_rank, four_layer_model_dir, tmp_path, tp, pp, vpp,
                                                  mode, micro, extra):
    """Virtual pipeline stages (megatron's interleaved schedule: each rank holds two non-adjacent layer chunks)
    against the padded one-rank policy: the same log-probs and gradients."""
    atol = 2e-6 if "sequence=true" in extra else 1e-6
    model_dir = four_layer_model_dir
    expected_logprobs, expected_gradient = logprobs_and_gradient(
        PolicyWorker(PolicySettings.of(config(model_dir, mode, 1, 1, 3))))
    world = tp * pp
    run_ranks("tests.policy_parallel_worker:main", world,
              [model_dir, str(tmp_path), mode, str(tp), str(pp), str(micro),
               f"actor.parallel.virtual_pipeline={vpp} {extra}"], timeout_s=900)
    last_stage = list(range(world - tp, world))
    assert [rank for rank in range(world) if (tmp_path / f"logprobs_rank{rank}.pt").exists()] == last_stage
    for rank in last_stage:
        torch.testing.assert_close(torch.load(tmp_path / f"logprobs_rank{rank}.pt"), expected_logprobs,
                                   atol=1e-5, rtol=0)
    assert any(t.abs().sum() > 0 for t in expected_gradient.values())
    for rank in range(world):
        gradient = load_file(tmp_path / f"gradient_rank{rank}.safetensors")
        assert sorted(gradient) == sorted(expected_gradient)
        for name, tensor in expected_gradient.items():
            assert (gradient[name] - tensor).abs().max().item() <= atol, (rank, name)
