"""Vocab-parallel log-probs and entropy against torch's log_softmax over the real vocabulary."""

import torch

from rl360.cluster.launch import run_ranks
from tests.vocab_parallel_worker import fixed_case, loss_and_gradient


def _reference(logits, targets, weights, vocab=60):
    logits = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(logits[..., :vocab], dim=-1)
    logprobs = logp.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    ((logprobs * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    return logprobs.detach(), entropy.detach(), logits.grad


def test_one_rank_matches_log_softmax(megatron_single_rank):
    logits, targets, weights = fixed_case()
    got = loss_and_gradient(logits, targets, weights, 60, 0)
    for value, expected in zip(got, _reference(logits, targets, weights)):
        torch.testing.assert_close(value, expected, atol=1e-5, rtol=1e-5)
        assert torch.isfinite(value).all()


def test_two_ranks_match_log_softmax_when_one_holds_only_padding(tmp_path):
    """Vocabulary 60 padded to 256 over TP=2: rank 1's slice is all padding (with large logits)."""
    logits, targets, weights = fixed_case()
    expected_logprobs, expected_entropy, expected_grad = _reference(logits, targets, weights)
    run_ranks("tests.vocab_parallel_worker:main", 2, [str(tmp_path)], timeout_s=300)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got["logprobs"], expected_logprobs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["entropy"], expected_entropy, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["grad"], expected_grad[..., rank * 128:(rank + 1) * 128], atol=1e-6, rtol=1e-5)
