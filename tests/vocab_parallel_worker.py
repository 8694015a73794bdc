"""One rank of tests/test_vocab_parallel.py: its slice of fixed logits through the vocab-parallel
log-probs and entropy; writes values and the gradient of its slice."""

import sys

import torch

from rl360.actor.parallel import init_parallel
from rl360.actor.vocab_parallel import logprobs_and_entropy, without_padding


def fixed_case(vocab: int = 60, padded: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits [3, 5, padded] (padding columns hold large values that must not count), targets, and the
    weights of the test's scalar loss."""
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 5, padded, generator=generator) * 4
    logits[..., vocab:] = 50.0
    logits[0, 0, :vocab] += 300.0  # a large shared offset: the max shift keeps exp() finite
    targets = torch.randint(0, vocab, (3, 5), generator=generator)
    weights = torch.randn(2, 3, 5, generator=generator)
    return logits, targets, weights


def loss_and_gradient(local: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, vocab: int,
                      start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    local = local.clone().requires_grad_(True)
    logprobs, entropy = logprobs_and_entropy(without_padding(local, vocab, start), targets, start)
    ((logprobs * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    return logprobs.detach(), entropy.detach(), local.grad


def main(out_dir: str) -> None:
    init_parallel(2, 1, seed=0)
    rank = torch.distributed.get_rank()
    logits, targets, weights = fixed_case()
    width = logits.shape[-1] // 2
    logprobs, entropy, grad = loss_and_gradient(logits[..., rank * width:(rank + 1) * width], targets, weights,
                                                60, rank * width)
    torch.save({"logprobs": logprobs, "entropy": entropy, "grad": grad}, f"{out_dir}/rank{rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
