"""The Megatron policy of a mixture-of-experts model: its log-probs equal the HF engine's, and at EP=2 (two
data-parallel gloo ranks, two experts each) its log-probs and gradient equal one rank's; the checkpoint the EP
ranks save converts back to the HF weights at EP=1."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from rl360.actor.batch import micro_batch_rows, split_to_count
from rl360.actor.policy import PolicyWorker
from rl360.cluster.launch import run_ranks
from rl360.rollout.hf_engine import HFEngine
from tests.dp_worker import fixed_batch
from tests.helpers import make_tiny_model
from tests.policy_parallel_worker import config, logprobs_and_gradient
from tests.test_policy import _config, _rollouts

pytestmark = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                                reason="two NCCL ranks need two GPUs (on CPU the ranks use gloo)")


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy_moe")
    return {arch: make_tiny_model(str(root / arch), arch, tie_word_embeddings=False, seed=21 + k, num_layers=2)
            for k, arch in enumerate(("qwen3_moe", "qwen2_moe"))}


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_trainer_logprobs_equal_engine_logprobs(megatron_single_rank, moe_dirs, arch):
    worker = PolicyWorker(_config(moe_dirs[arch]))
    batch = _rollouts(HFEngine(moe_dirs[arch]))
    logprobs = worker.compute_logprobs(batch)
    diff = (logprobs - batch.rollout_logprobs).abs() * batch.response_mask
    assert diff.sum() / batch.response_mask.sum() <= 1e-6
    assert diff.max().item() <= 1e-5


UNEVEN_BUDGET = 18  # tokens per micro-batch: the fixed batch's halves make 4 and 5 micro-batches


def test_token_budget_splits_the_halves_unevenly_and_split_to_count_evens_them():
    halves = [fixed_batch().select(slice(r * 8, (r + 1) * 8)) for r in range(2)]
    rows = [micro_batch_rows(half.sequence_lengths(), 3, UNEVEN_BUDGET) for half in halves]
    assert [len(r) for r in rows] == [4, 5]
    evened = split_to_count(rows[0], 5)
    assert len(evened) == 5 and all(len(group) for group in evened)
    assert torch.equal(torch.sort(torch.cat(evened)).values, torch.arange(8))  # every row once
    with pytest.raises(ValueError, match="8 rows cannot make 9 micro-batches"):
        split_to_count(rows[0], 9)


@pytest.mark.parametrize("arch, mode, extra", [
    ("qwen3_moe", "token-mean", ""),
    # token budgets split the two ranks' halves into different numbers of micro-batches: the policy evens them
    ("qwen2_moe", "seq-mean-token-sum-norm", f"actor.max_tokens_per_micro_batch={UNEVEN_BUDGET}"),
])
def test_expert_parallel_policy_matches_one_rank(megatron_single_rank, moe_dirs, tmp_path, arch, mode, extra):
    model_dir, micro = moe_dirs[arch], 3
    expected_logprobs, expected_gradient = logprobs_and_gradient(
        PolicyWorker(config(model_dir, mode, 1, 1, micro, *filter(None, [extra]))))
    run_ranks("tests.policy_parallel_worker:expert_parallel", 2, [model_dir, str(tmp_path), mode, str(micro), extra],
              timeout_s=600)
    half = len(expected_logprobs) // 2
    for rank in range(2):  # each data-parallel rank's half of the batch
        got = torch.load(tmp_path / f"logprobs_rank{rank}.pt")
        mine = expected_logprobs[rank * half:(rank + 1) * half]
        torch.testing.assert_close(got, mine[:, :got.shape[1]], atol=1e-5, rtol=0)
        assert mine[:, got.shape[1]:].abs().sum() == 0
    expert_rows = [name for name in expected_gradient if ".mlp.experts." in name]
    assert all(expected_gradient[name].abs().sum() > 0 for name in expert_rows)  # every expert got tokens
    for rank in range(2):
        gradient = load_file(tmp_path / f"gradient_rank{rank}.safetensors")
        assert sorted(gradient) == sorted(expected_gradient)
        for name, tensor in expected_gradient.items():
            assert (gradient[name] - tensor).abs().max().item() <= 1e-6, (rank, name)
    # the checkpoint saved at EP=2 (experts split over the two ranks) converts to the HF weights at EP=1
    subprocess.run([sys.executable, "-m", "rl360.cli", "convert", "megatron-to-hf", "--ckpt", str(tmp_path / "ckpt"),
                    "--out", str(tmp_path / "back")], check=True, timeout=600)
    original = load_file(f"{model_dir}/model.safetensors")
    converted = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(converted) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor), name
