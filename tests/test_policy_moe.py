"""The Megatron policy of a mixture-of-experts model: its log-probs equal the HF engine's, before and after an
update and weight sync; at EP=2 (two data-parallel gloo ranks, two experts each) its log-probs and gradient equal
one rank's; after an update at EP=2 its checkpoint restores the weights and Adam state, and converts to the same HF
weights at EP=1."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from rl360.actor.batch import at_least, micro_batch_rows
from rl360.actor.policy import PolicyWorker
from rl360.actor.settings import PolicySettings
from rl360.cluster.launch import run_ranks
from rl360.engine.hf_engine import HFEngine
from tests.dp_worker import fixed_batch
from tests.helpers import make_tiny_model
from tests.policy_parallel_worker import config, logprobs_and_gradient
from tests.rank_cases import launch_by_world, output
from tests.test_policy import _config, _rollouts


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy_moe")
    return {arch: make_tiny_model(str(root / arch), arch, tie_word_embeddings=False, seed=21 + k, num_layers=2)
            for k, arch in enumerate(("qwen3_moe", "qwen2_moe"))}


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_trainer_logprobs_equal_engine_logprobs(megatron_single_rank, moe_dirs, arch):
    worker = PolicyWorker(PolicySettings.of(_config(moe_dirs[arch])))
    batch = _rollouts(HFEngine(moe_dirs[arch]))
    logprobs = worker.compute_logprobs(batch)
    diff = (logprobs - batch.rollout_logprobs).abs() * batch.response_mask
    assert diff.sum() / batch.response_mask.sum() <= 1e-6
    assert diff.max().item() <= 1e-5


UNEVEN_BUDGET = 18  # tokens per micro-batch: the fixed batch's halves make 4 and 5 micro-batches


def test_token_budget_splits_the_halves_unevenly_and_at_least_evens_them():
    halves = [fixed_batch().select(slice(r * 8, (r + 1) * 8)) for r in range(2)]
    rows = [micro_batch_rows(half.sequence_lengths(), 3, UNEVEN_BUDGET) for half in halves]
    assert [len(r) for r in rows] == [4, 5]
    evened = at_least(rows[0], 5)
    assert len(evened) == 5 and all(len(group) for group in evened)
    assert torch.equal(torch.sort(torch.cat(evened)).values, torch.arange(8))  # every row once
    with pytest.raises(ValueError, match="8 rows on this rank cannot make 9 micro-batches"):
        at_least(rows[0], 9)


EXPERT_PARALLEL = [  # (arch, mode, extra, dp, ep)
    ("qwen3_moe", "token-mean", "", 2, 2),
    # token budgets split the two ranks' halves into different numbers of micro-batches: the policy evens them
    ("qwen2_moe", "seq-mean-token-sum-norm", f"actor.max_tokens_per_micro_batch={UNEVEN_BUDGET}", 2, 2),
    # two expert-data-parallel replicas: each expert's gradient all-reduced over the two ranks that hold it
    ("qwen2_moe", "token-mean", "", 4, 2),
]
MICRO = 3


@pytest.fixture(scope="module")
def launched(moe_dirs, tmp_path_factory):
    """Every EXPERT_PARALLEL case through `tests.policy_parallel_worker:expert_parallel`, one launch of the ranks
    per world size (`tests.rank_cases`)."""
    cases = {case: (case[3], [moe_dirs[case[0]], case[1], str(MICRO), case[2], str(case[3]), str(case[4])])
             for case in EXPERT_PARALLEL}
    return launch_by_world("tests.policy_parallel_worker:expert_parallel", cases, tmp_path_factory.mktemp("ep_ranks"))


@pytest.mark.parametrize("arch, mode, extra, dp, ep", EXPERT_PARALLEL,
                         ids=["qwen3_moe-dp2ep2", "qwen2_moe-dp2ep2-token-budget", "qwen2_moe-dp4ep2"])
def test_expert_parallel_policy_matches_one_rank(megatron_single_rank, moe_dirs, launched, arch, mode, extra, dp,
                                                 ep):
    model_dir = moe_dirs[arch]
    expected_logprobs, expected_gradient = logprobs_and_gradient(
        PolicyWorker(PolicySettings.of(config(model_dir, mode, 1, 1, MICRO, *filter(None, [extra])))))
    tmp_path = output(launched, (arch, mode, extra, dp, ep))
    share = len(expected_logprobs) // dp
    for rank in range(dp):  # each data-parallel rank's share of the batch
        got = torch.load(tmp_path / f"logprobs_rank{rank}.pt")
        mine = expected_logprobs[rank * share:(rank + 1) * share]
        torch.testing.assert_close(got, mine[:, :got.shape[1]], atol=1e-5, rtol=0)
        assert mine[:, got.shape[1]:].abs().sum() == 0
    expert_rows = [name for name in expected_gradient if ".mlp.experts." in name]
    assert all(expected_gradient[name].abs().sum() > 0 for name in expert_rows)  # every expert got tokens
    for rank in range(dp):
        gradient = load_file(tmp_path / f"gradient_rank{rank}.safetensors")
        assert sorted(gradient) == sorted(expected_gradient)
        for name, tensor in expected_gradient.items():
            assert (gradient[name] - tensor).abs().max().item() <= 1e-6, (rank, name)


def test_expert_parallel_checkpoint_round_trip_and_conversion(moe_dirs, tmp_path):
    """After an update at EP=2 (with the distributed optimizer: expert state split over the expert-data-parallel
    ranks, the rest over DP) the policy's checkpoint restores every rank's weights and Adam state; converted at
    EP=1 it gives the weights the EP ranks exported, bitwise. Each rank's optimizer state is what `rl360 plan`
    counts."""
    from rl360.plan import plan

    model_dir = moe_dirs["qwen2_moe"]
    run_ranks("tests.policy_parallel_worker:expert_parallel_checkpoint", 2,
              [model_dir, str(tmp_path), "actor.distributed_optimizer=true"], timeout_s=600)
    # `rl360 plan`'s optimizer term: the dense state split over the 2 DP ranks, each expert's whole on its EP rank
    terms = {term.name.split(" (")[0]: term.bytes for term in plan(config(
        model_dir, "token-mean", 1, 1, 3, "actor.parallel.data=2", "actor.parallel.expert=2",
        "actor.distributed_optimizer=true")).terms}
    for rank in range(2):
        measured = int((tmp_path / f"optimizer_bytes_rank{rank}.txt").read_text())
        assert terms["policy optimizer"] == pytest.approx(measured, rel=0.01), (rank, terms, measured)
    subprocess.run([sys.executable, "-m", "rl360.cli", "convert", "megatron-to-hf", "--ckpt", str(tmp_path / "ckpt"),
                    "--out", str(tmp_path / "back")], check=True, timeout=600)
    exported = load_file(tmp_path / "exported.safetensors")
    converted = load_file(tmp_path / "back" / "model.safetensors")
    original = load_file(f"{model_dir}/model.safetensors")
    assert sorted(converted) == sorted(exported) == sorted(original)
    assert not torch.equal(exported["model.layers.0.mlp.experts.3.down_proj.weight"],
                           original["model.layers.0.mlp.experts.3.down_proj.weight"])  # the update moved them
    for name, tensor in exported.items():
        assert torch.equal(converted[name], tensor), name


def test_update_then_sync_keeps_engine_and_trainer_identical(megatron_single_rank, moe_dirs):
    """Per-expert HF weights from the trainer land in the HF engine's fused experts (transformers 5)."""
    model_dir = moe_dirs["qwen3_moe"]
    worker = PolicyWorker(PolicySettings.of(_config(model_dir)))
    engine = HFEngine(model_dir)
    batch = _rollouts(engine, seed=1)
    batch.old_logprobs = worker.compute_logprobs(batch)
    assert worker.update(batch)["actor/grad_norm"] > 0
    for bucket in worker.export_weights():
        engine.update_weights(bucket, version=1)
    assert engine.finish_weight_update(1) == 1
    fresh = _rollouts(engine, seed=11)  # sampled from the synced weights
    diff = (worker.compute_logprobs(fresh) - fresh.rollout_logprobs).abs() * fresh.response_mask
    assert diff.sum() / fresh.response_mask.sum() <= 1e-6 and diff.max().item() <= 1e-5
    for bucket in worker.export_weights():  # a bucket without one expert's up projection leaves it unset
        engine.update_weights([(n, t) for n, t in bucket if n != "model.layers.1.mlp.experts.3.up_proj.weight"], 2)
    with pytest.raises(RuntimeError, match=r"left parameters unset: \['model.layers.1.mlp.experts.gate_up_proj'\]"):
        engine.finish_weight_update(2)


def test_router_load_balancing_loss_reaches_the_router_only_when_configured(megatron_single_rank, moe_dirs):
    model_dir = moe_dirs["qwen2_moe"]
    batch = fixed_batch()
    grads = {}
    for coef in (0.0, 0.1):
        worker = PolicyWorker(PolicySettings.of(_config(model_dir, f"actor.moe_aux_loss_coef={coef}")))
        batch.old_logprobs = worker.compute_logprobs(batch) - 0.05
        worker.accumulate_gradients(batch)
        grads[coef] = {name: p.main_grad.clone() for name, p in worker.models[0].module.named_parameters()}
    router = "decoder.layers.1.mlp.router.weight"
    assert (grads[0.1][router] - grads[0.0][router]).abs().max() > 1e-6
    last_expert = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"  # after the router: untouched
    torch.testing.assert_close(grads[0.1][last_expert], grads[0.0][last_expert], atol=1e-7, rtol=0)
