"""Virtual pipeline stages (`actor.parallel.virtual_pipeline`, megatron's interleaved schedule) in training: four
updates at PP=2 x VPP=2 land where one rank's do, and the run's checkpoint resumes on one rank. The per-step
log-probs and gradients are compared in tests/test_policy_parallel.py."""

import pytest
import torch
from safetensors.torch import load_file

from rl360.actor.batch import at_least, interleaved_micro_batches, interleaving_group
from rl360.actor.policy import PolicyWorker
from rl360.actor.settings import PolicySettings
from rl360.cluster.launch import run_ranks
from rl360.config import ConfigError, load_config
from tests.helpers import make_tiny_qwen2
from tests.policy_parallel_worker import weights_as_hf
from tests.zero_worker import config, train


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen2(str(tmp_path_factory.mktemp("vpp")), tie_word_embeddings=False, seed=11, num_layers=4)


@pytest.fixture(scope="module")
def interleaved(model_dir, tmp_path_factory):
    """PP=2 x VPP=2, micro-batches of 3 rows: 3 updates, weights and checkpoint, a 4th update, weights."""
    out = tmp_path_factory.mktemp("vpp_run")
    run_ranks("tests.policy_parallel_worker:train_and_checkpoint", 2,
              [model_dir, str(out), "1", "2", "actor.parallel.virtual_pipeline=2 actor.micro_batch_size=3"],
              timeout_s=600)
    return {"weights": load_file(out / "weights.safetensors"), "after": load_file(out / "weights_after.safetensors"),
            "reports": torch.load(out / "reports.pt"), "ckpt": str(out / "ckpt")}


def _assert_close(got: dict, want: dict, atol: float) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert (got[name] - tensor).abs().max().item() <= atol, name


def test_interleaved_training_lands_where_one_rank_does(megatron_single_rank, model_dir, interleaved):
    worker = PolicyWorker(PolicySettings.of(config(model_dir, 1, "actor.micro_batch_size=3")))
    start = weights_as_hf(worker)
    reports = train(worker)
    # gradients agree to ~1e-7 (tests/test_policy_parallel.py); Adam at lr 1e-2 scales a parameter's tiny
    # gradient up to a step of ~lr, so a difference in rounding can move it by 1e-5 (measured 2.1e-5 after 3)
    _assert_close(interleaved["weights"], weights_as_hf(worker), 1e-4)
    assert max((interleaved["weights"][name] - start[name]).abs().max().item() for name in start) > 1e-3
    for got, want in zip(interleaved["reports"], reports):
        assert got["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-5)
        assert got["actor/pg_loss"] == pytest.approx(want["actor/pg_loss"], rel=1e-5, abs=1e-7)


def test_an_interleaved_checkpoint_resumes_on_one_rank(megatron_single_rank, model_dir, interleaved):
    """The checkpoint holds "model0" / "model1" chunks keyed by global layer: one rank loads it whole, and its
    4th update lands where the interleaved run's did."""
    worker = PolicyWorker(PolicySettings.of(config(model_dir, 1, "actor.micro_batch_size=3")))
    worker.load_checkpoint(interleaved["ckpt"])
    _assert_close(weights_as_hf(worker), interleaved["weights"], 0.0)
    train(worker, steps=1, first=3)
    _assert_close(weights_as_hf(worker), interleaved["after"], 1e-4)


def test_interleaving_needs_a_pipeline():
    with pytest.raises(ConfigError, match=r"actor.parallel.virtual_pipeline=2 .* needs actor.parallel.pipeline > 1"):
        load_config(None, ["model.path=m", "data.train_files=[x.parquet]", "actor.parallel.virtual_pipeline=2"])


def test_micro_batches_are_split_until_every_stage_has_one():
    groups = at_least([torch.arange(0, 5), torch.arange(5, 6)], 4)
    assert [g.tolist() for g in groups] == [[0, 1], [2], [3, 4], [5]]
    assert at_least(groups, 2) == groups
    with pytest.raises(ValueError, match="3 rows on this rank cannot make 4 micro-batches"):
        at_least([torch.arange(3)], 4)


@pytest.mark.parametrize("micro, pipeline, group", [(6, 2, 2), (5, 2, 3), (7, 3, 4), (8, 4, 4), (10, 4, 5), (9, 2, 3)])
def test_the_interleaving_group_leaves_no_short_last_group(micro, pipeline, group):
    assert interleaving_group(micro, pipeline) == group
    assert micro % group == 0 or micro % group >= pipeline


@pytest.mark.parametrize("count, pipeline, chunks, needed", [
    (1, 2, 2, 3), (2, 2, 2, 3), (3, 2, 2, 3), (6, 2, 2, 6), (1, 4, 2, 7), (5, 4, 2, 7), (8, 4, 2, 8), (2, 2, 4, 3)])
def test_no_stage_spends_the_whole_update_in_warm_up(count, pipeline, chunks, needed):
    """More micro-batch passes than the first stage's warm-up (megatron: 2 (PP - 1) + (VPP - 1) x group)."""
    assert interleaved_micro_batches(count, pipeline, chunks) == needed
    group = interleaving_group(needed, pipeline)
    assert needed * chunks > 2 * (pipeline - 1) + (chunks - 1) * group
