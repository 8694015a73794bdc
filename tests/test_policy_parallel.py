"""The Megatron policy at TP=2 and PP=2 (gloo processes) against the same policy in one process: the same
log-probs and the same gradient, for each loss aggregation, with uneven micro-batches, padded or packed.

The layouts of one world size run in one launch of their ranks, one case after another (`launched`): starting
the ranks costs more than a case."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl360.actor.policy import PolicyWorker
from rl360.actor.settings import PolicySettings
from tests.helpers import make_tiny_qwen2
from tests.policy_parallel_worker import config, logprobs_and_gradient
from tests.rank_cases import launch_by_world, output


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen2(str(tmp_path_factory.mktemp("policy_tp")), tie_word_embeddings=True, seed=5)


@pytest.fixture(scope="module")
def four_layer_model_dir(tmp_path_factory):
    return make_tiny_qwen2(str(tmp_path_factory.mktemp("policy_vpp")), tie_word_embeddings=True, seed=6,
                           num_layers=4)


PACKED = "actor.pack_sequences=true"

# (tp, pp, mode, extra)
MODEL_PARALLEL = [
    (2, 1, "token-mean", ""), (1, 2, "seq-mean-token-sum-norm", ""), (2, 1, "seq-mean-token-mean", ""),
    (1, 2, "token-mean", ""),
    # packed sequences (one row per micro-batch, no padding) against the padded one-rank policy
    (2, 1, "seq-mean-token-mean", PACKED), (1, 2, "token-mean", f"{PACKED} actor.max_tokens_per_micro_batch=24"),
]
# (tp, pp, cp, mode, extra)
CONTEXT_AND_SEQUENCE = [
    (1, 1, 2, "token-mean", ""),  # padded rows, each split in 4 chunks over 2 ranks
    (1, 1, 2, "seq-mean-token-mean", PACKED),  # each packed sequence padded to a multiple of 4 and split
    (2, 2, 2, "token-mean", f"{PACKED} actor.max_tokens_per_micro_batch=24"),
    # sequence parallelism: tokens split over the tensor-parallel ranks outside the attention and MLP blocks
    (2, 1, 1, "seq-mean-token-sum", "actor.parallel.sequence=true"),
    (2, 2, 2, "token-mean", f"{PACKED} actor.parallel.sequence=true"),
]
# (tp, pp, vpp, mode, micro, extra)
VIRTUAL_PIPELINE = [
    (1, 2, 2, "token-mean", 3, ""),  # 6 micro-batches of uneven size and width
    (1, 2, 2, "seq-mean-token-mean", 16, ""),  # one micro-batch of 16 rows: split in two for the two stages
    (1, 2, 2, "seq-mean-token-sum-norm", 3, f"{PACKED} actor.max_tokens_per_micro_batch=40"),
    (2, 2, 2, "token-mean", 3, f"{PACKED} actor.parallel.sequence=true"),
]


def _cases(model_dir: str, four_layer_model_dir: str) -> dict[tuple, tuple[int, list[str]]]:
    """Every case's key -> its world size and `tests.policy_parallel_worker:main`'s arguments (but the output
    directory)."""
    found = {}
    for tp, pp, mode, extra in MODEL_PARALLEL:
        found[("tp", tp, pp, mode, extra)] = (tp * pp, [model_dir, mode, str(tp), str(pp), "3", extra])
    for tp, pp, cp, mode, extra in CONTEXT_AND_SEQUENCE:
        found[("cp", tp, pp, cp, mode, extra)] = (tp * pp * cp, [model_dir, mode, str(tp), str(pp), "3",
                                                                 f"actor.parallel.context={cp} {extra}"])
    for tp, pp, vpp, mode, micro, extra in VIRTUAL_PIPELINE:
        found[("vpp", tp, pp, vpp, mode, micro, extra)] = (tp * pp, [
            four_layer_model_dir, mode, str(tp), str(pp), str(micro), f"actor.parallel.virtual_pipeline={vpp} {extra}"])
    return found


@pytest.fixture(scope="module")
def launched(model_dir, four_layer_model_dir, tmp_path_factory):
    """Every case run at its layout, one launch per world size (`tests.rank_cases`)."""
    return launch_by_world("tests.policy_parallel_worker:main", _cases(model_dir, four_layer_model_dir),
                           tmp_path_factory.mktemp("policy_parallel_cases"))


def _one_rank(model_dir: str, mode: str, micro: int):
    """The one-rank policy's log-probs and gradient: what every layout must match."""
    return logprobs_and_gradient(PolicyWorker(PolicySettings.of(config(model_dir, mode, 1, 1, micro))))


def _assert_matches(out: Path, world: int, last_stage: list[int], expected_logprobs, expected_gradient,
                    atol: float) -> None:
    """The last stage's ranks hold the one-rank policy's log-probs, every rank its gradient (HF names)."""
    assert [rank for rank in range(world) if (out / f"logprobs_rank{rank}.pt").exists()] == last_stage
    for rank in last_stage:
        torch.testing.assert_close(torch.load(out / f"logprobs_rank{rank}.pt"), expected_logprobs, atol=1e-5, rtol=0)
    assert any(t.abs().sum() > 0 for t in expected_gradient.values())
    for rank in range(world):
        gradient = load_file(out / f"gradient_rank{rank}.safetensors")
        assert sorted(gradient) == sorted(expected_gradient)
        for name, tensor in expected_gradient.items():
            assert (gradient[name] - tensor).abs().max().item() <= atol, (rank, name)


@pytest.mark.parametrize("tp, pp, mode, extra", MODEL_PARALLEL)
def test_model_parallel_policy_matches_one_rank(megatron_single_rank, model_dir, launched, tp, pp, mode, extra):
    micro = 3  # 16 samples in micro-batches of 3: the last one is smaller, and widths differ
    expected_logprobs, expected_gradient = _one_rank(model_dir, mode, micro)
    out = output(launched, ("tp", tp, pp, mode, extra))
    _assert_matches(out, tp * pp, list(range(tp * pp - tp, tp * pp)), expected_logprobs, expected_gradient, 1e-6)


@pytest.mark.parametrize("tp, pp, cp, mode, extra", CONTEXT_AND_SEQUENCE)
def test_context_and_sequence_parallel_policy_matches_one_rank(megatron_single_rank, model_dir, launched, tp, pp, cp,
                                                              mode, extra):
    """Context and sequence parallelism (with TP and PP, padded or packed) against the padded one-rank policy."""
    # sequence parallelism sums the tied embedding's gradient in another order (measured: 1.5e-6 apart)
    atol = 2e-6 if "sequence=true" in extra else 1e-6
    expected_logprobs, expected_gradient = _one_rank(model_dir, mode, 3)
    world = tp * pp * cp
    out = output(launched, ("cp", tp, pp, cp, mode, extra))
    # megatron orders ranks TP fastest, then CP, ..., PP last
    _assert_matches(out, world, list(range(world - tp * cp, world)), expected_logprobs, expected_gradient, atol)


@pytest.mark.parametrize("tp, pp, vpp, mode, micro, extra", VIRTUAL_PIPELINE)
def test_virtual_pipeline_policy_matches_one_rank(megatron_single_rank, four_layer_model_dir, launched, tp, pp, vpp,
                                                  mode, micro, extra):
    """Virtual pipeline stages (megatron's interleaved schedule: each rank holds two non-adjacent layer chunks)
    against the padded one-rank policy: the same log-probs and gradients."""
    atol = 2e-6 if "sequence=true" in extra else 1e-6
    expected_logprobs, expected_gradient = _one_rank(four_layer_model_dir, mode, 3)
    out = output(launched, ("vpp", tp, pp, vpp, mode, micro, extra))
    _assert_matches(out, tp * pp, list(range(tp * pp - tp, tp * pp)), expected_logprobs, expected_gradient, atol)
