"""`actor.offload`: the policy's optimizer state, gradients and reference model leave device memory between the
calls that use them, and training is bit-for-bit what it is without offload."""

import pytest
import torch

from rl360.actor.offload import StateOffload
from rl360.actor.policy import PolicyWorker
from rl360.actor.settings import PolicySettings
from rl360.config import load_config
from tests.dp_worker import fixed_batch
from tests.helpers import make_tiny_qwen2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen2(str(tmp_path_factory.mktemp("offload")), tie_word_embeddings=False, seed=9)


def _config(model_dir, *overrides):
    return load_config(None, [f"model.path={model_dir}", "data.train_files=[unused.parquet]", "rollout.n=4",
                              "data.batch_size=4", "actor.ppo_mini_batch_size=2", "actor.micro_batch_size=4",
                              "actor.lr=1e-2", "algorithm.kl_coef=0.01", *overrides])


def _train(worker: PolicyWorker, steps: int = 3) -> list[dict[str, float]]:
    reports = []
    for step in range(steps):
        batch = fixed_batch()
        batch.advantages = batch.advantages * (1 + step)
        batch.old_logprobs = worker.compute_logprobs(batch) - 0.05
        batch.ref_logprobs = worker.compute_logprobs(batch, reference=True)
        reports.append(worker.update(batch))
    return reports


def _weights(worker: PolicyWorker) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for bucket in worker.export_weights() for name, tensor in bucket}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offloaded_training_is_bitwise_the_resident_one(megatron_single_rank, model_dir, dtype):
    resident = PolicyWorker(PolicySettings.of(_config(model_dir, f"model.dtype={dtype}")))
    offloaded = PolicyWorker(PolicySettings.of(_config(model_dir, f"model.dtype={dtype}", "actor.offload=true")))
    assert _train(offloaded) == _train(resident)  # losses, grad norms, KL: every metric of every step
    expected, got = _weights(resident), _weights(offloaded)
    assert expected.keys() == got.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    # between calls only the weights stay; the Adam state, fp32 main weights, gradients and reference are parked
    held = offloaded.offload.resident_bytes()
    assert held["weights"] > 0 and held["optimizer"] == held["grads"] == held["reference"] == 0
    assert set(offloaded.offload.offloaded) == {"optimizer", "grads", "reference"}
    parked = sum(size for saved in offloaded.offload.offloaded.values() for _, size, _ in saved)
    optimizer_bytes = sum(size for _, size, _ in offloaded.offload.offloaded["optimizer"])
    params = sum(p.numel() for p in offloaded.models[0].parameters())
    # Adam's two fp32 moments (+ the fp32 main weights of bf16 parameters), and a step counter per tensor
    assert optimizer_bytes >= params * (8 if dtype == "float32" else 12)
    assert parked > optimizer_bytes


def test_the_optimizer_state_is_on_the_device_only_for_its_steps(megatron_single_rank, model_dir):
    """An update's forward and backward passes (its largest memory: activations) run without the optimizer state;
    each optimizer step has it, and the gradients with it."""
    worker = PolicyWorker(PolicySettings.of(_config(model_dir, "model.dtype=bfloat16", "actor.offload=true")))
    seen = {"passes": [], "steps": []}
    schedule, step = worker._schedule, worker.optimizer.step

    def recording_schedule(*args, **kwargs):
        seen["passes"].append(worker.offload.resident_bytes())
        return schedule(*args, **kwargs)

    def recording_step():
        seen["steps"].append(worker.offload.resident_bytes())
        return step()

    worker._schedule, worker.optimizer.step = recording_schedule, recording_step
    _train(worker)
    updates = [held for held in seen["passes"] if held["grads"] > 0]  # (log-prob passes have no gradients)
    assert updates and all(held["optimizer"] == 0 and held["weights"] > 0 for held in updates)
    assert seen["steps"] and all(held["optimizer"] > 0 and held["grads"] > 0 for held in seen["steps"])
    assert worker.offload.resident_bytes()["optimizer"] == 0


def test_colocated_engines_get_the_weights_memory_too(megatron_single_rank, model_dir):
    worker = PolicyWorker(PolicySettings.of(_config(model_dir, "actor.offload=true", "rollout.engine=server")),
                          colocated=True)
    before = _weights(worker)
    assert worker.offload.resident_bytes() == {"weights": 0, "grads": 0, "optimizer": 0, "reference": 0}
    _train(worker, steps=1)
    assert all(size == 0 for size in worker.offload.resident_bytes().values())
    after = _weights(worker)  # reloaded for the export, with the update's values
    assert any(not torch.equal(after[name], before[name]) for name in before)
    assert all(size == 0 for size in worker.offload.resident_bytes().values())


def test_checkpoint_of_an_offloaded_policy_restores_its_optimizer(megatron_single_rank, model_dir, tmp_path):
    """Save while offloaded, load into a fresh offloading worker: the next update matches the uninterrupted one."""
    first = PolicyWorker(PolicySettings.of(_config(model_dir, "actor.offload=true")))
    _train(first, steps=2)
    first.save_checkpoint(str(tmp_path / "ckpt"))
    second = PolicyWorker(PolicySettings.of(_config(model_dir, "actor.offload=true")))
    second.load_checkpoint(str(tmp_path / "ckpt"))
    assert _train(second, steps=1) == _train(first, steps=1)
    expected, got = _weights(first), _weights(second)
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def test_shared_storages_belong_to_the_first_group_and_gradients_come_back_zeroed():
    weight = torch.nn.Parameter(torch.randn(6))
    grad = torch.randn(6)
    view = grad[2:4]
    offload = StateOffload({"weights": lambda: [weight], "grads": lambda: [grad],
                            "optimizer": lambda: [weight]},  # fp32: the parameter is its own main weight
                           keep_values={"weights": True, "grads": False, "optimizer": True})
    assert offload.resident_bytes() == {"weights": 24, "grads": 24, "optimizer": 0}
    values = weight.detach().clone()
    with offload.using("weights"):
        assert offload.resident_bytes() == {"weights": 24, "grads": 0, "optimizer": 0}
        with offload.using("grads"):  # nested: the outer call's groups stay
            assert grad.untyped_storage().size() == 24 and weight.untyped_storage().size() == 24
        assert grad.untyped_storage().size() == 24
    assert offload.resident_bytes() == {"weights": 0, "grads": 0, "optimizer": 0}
    offload.reload("weights")
    offload.reload("grads")
    assert torch.equal(weight.detach(), values) and torch.equal(view, torch.zeros(2))
