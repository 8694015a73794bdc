"""The placement plan: who runs on which GPU, decided before anything starts, refused in seconds when it cannot fit.

The decisions are pure (a count of GPUs in, a placement or a PlacementError out); the whole runs start a local Ray
cluster that declares GPUs on this CPU machine (`cluster.num_gpus`), so Ray places the workers as it would on a
GPU machine while they compute on the CPU: the one-GPU quickstart that used to wait forever for a second GPU, and
a colocated server engine whose `distributed` weight sync NCCL would refuse.
"""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import ray

from rl360.cluster.groups import WorkerGroup, start_ray
from rl360.cluster.placement import PlacementError, gpus_asked, make_placement
from rl360.config import RolloutConfig
from rl360.quickstart.assets import build_quickstart_model

REPO = Path(__file__).resolve().parents[1]


def _declarable_env() -> dict[str, str]:
    """The environment without the suite's CUDA hiding (conftest.py), which Ray refuses beside declared GPUs; on
    a GPU machine the declared GPU is then the real one."""
    return {key: value for key, value in os.environ.items() if (key, value) != ("CUDA_VISIBLE_DEVICES", "")}


def _rollout(**settings) -> RolloutConfig:
    return replace(RolloutConfig(), **settings)


def test_the_placement_reads_the_strategies_registrations():
    """What a colocated engine may take is each strategy's registration: one that shares a GPU with SGLang engines
    colocates them, and a stand-in replaces a sync that cannot share a GPU."""
    from rl360.weight_sync.registry import register_strategy, unregister_strategy

    class Shared:
        @classmethod
        def from_options(cls, calls, options):
            return cls()

    with pytest.raises(PlacementError, match="can take weights only from disk here"):
        make_placement(1, False, _rollout(engine="sglang", colocate=True), gpus=1)
    register_strategy("shared_in_test", summary="a test's", engines=("sglang",), stand_in=True)(Shared)
    try:
        placement = make_placement(1, False, _rollout(engine="sglang", colocate=True), gpus=1)
        assert placement.colocate and placement.weight_sync == "shared_in_test"
        assert "using rollout.weight_sync=shared_in_test (a test's)" in placement.notes[0]
    finally:
        unregister_strategy("shared_in_test")


def test_one_gpu_colocates_the_default_hf_engine_on_policy_rank_0():
    placement = make_placement(1, False, _rollout(), gpus=1)
    assert placement.colocate and placement.gpus_needed == 1 and placement.gpu_share == 0.5
    assert placement.weight_sync == "distributed"  # the hf engine takes its weights through Ray, not this
    text = placement.describe()
    assert "1 of 1 GPU(s)" in text and "hf engine on policy rank 0's GPU (colocated)" in text
    assert "2 GPUs needed for separate engines (policy 1 + engines 1); this cluster has 1" in text


def test_enough_gpus_keep_engines_apart_and_change_nothing():
    rollout = _rollout(engine="sglang", num_engines=2, engine_tensor_parallel=2)
    assert rollout.colocate is None  # unset by default
    placement = make_placement(4, False, rollout, gpus=8)
    assert not placement.colocate and placement.notes == () and placement.gpu_share == 1.0
    assert placement.gpus_needed == 8 == gpus_asked(4, False, rollout)
    visible = [str(d) for d in range(8)]
    assert placement.engine_devices(0, visible) == ["4", "5"] and placement.engine_devices(1, visible) == ["6", "7"]
    assert placement.engine_devices(1, ["3", "1", "7", "0", "6", "2", "5", "4"]) == ["5", "4"]  # Slurm's order


def test_colocated_server_engines_get_a_weight_sync_that_runs_on_one_gpu():
    placement = make_placement(2, False, _rollout(engine="server", num_engines=2), gpus=2)
    assert placement.colocate and placement.weight_sync == "tensor"
    assert any("weight_sync=distributed cannot run colocated on GPUs" in note for note in placement.notes)
    assert placement.engine_devices(0, ["0", "1"]) == ["0"] and placement.engine_devices(1, ["0", "1"]) == ["1"]
    kept = make_placement(2, False, _rollout(engine="server", colocate=True, weight_sync="disk"), gpus=2)
    assert kept.weight_sync == "disk" and kept.notes == ()  # a sync that runs on one GPU is kept
    sglang = make_placement(1, False, _rollout(engine="sglang", weight_sync="disk"), gpus=1)
    assert sglang.colocate and sglang.weight_sync == "disk"


@pytest.mark.parametrize("ranks, critic, settings, gpus, message", [
    (2, False, {}, 1, "2 GPUs needed for the trainer alone (policy 2: actor.parallel tensor x pipeline x context x "
                      "data); this cluster has 1"),
    (1, True, {}, 1, "2 GPUs needed for the trainer alone (policy 1 + critic 1"),
    (1, False, {"engine": "server", "mode": "async"}, 1,
     "2 GPUs needed: policy 1 + engines 1; this cluster has 1: the engines cannot be colocated (rollout.mode=async: "
     "colocated engines release the GPU while the trainer trains, which needs rollout.mode=sync), lower "
     "rollout.num_engines"),
    (1, False, {"colocate": False}, 1, "2 GPUs needed: policy 1 + engines 1; this cluster has 1: set "
                                       "rollout.colocate=true or leave it unset"),
    (2, False, {"engine": "sglang", "num_engines": 2, "engine_tensor_parallel": 2}, 4,
     "6 GPUs needed: policy 2 + engines 2 x 2; this cluster has 4: the engines cannot be colocated (SGLang engines "
     "on the trainer's GPUs can take weights only from disk here"),
    (1, False, {"engine": "server", "colocate": True, "engine_hosts": "ray"}, 1,
     "rollout.colocate=true cannot run here: rollout.engine_hosts=ray places engines on GPUs of their own"),
    (1, False, {"engine": "sglang"}, 1, "2 GPUs needed: policy 1 + engines 1; this cluster has 1: the engines "
                                        "cannot be colocated (SGLang engines on the trainer's GPUs"),
    (1, False, {"engine": "sglang", "colocate": True}, 1, "SGLang engines on the trainer's GPUs can take weights "
                                                          "only from disk here"),
    (1, False, {"engine": "server", "colocate": True, "num_engines": 2}, 2,
     "rollout.colocate=true cannot run here: 2 engine(s) x 1 GPU(s) do not fit on the policy's 1 GPU(s)"),
])
def test_a_layout_that_cannot_run_is_refused_naming_the_counts(ranks, critic, settings, gpus, message):
    with pytest.raises(PlacementError) as refused:
        make_placement(ranks, critic, _rollout(**settings), gpus=gpus)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_engine_devices_past_the_node_are_refused():
    placement = make_placement(2, False, _rollout(engine="sglang", num_engines=2, engine_tensor_parallel=2), gpus=6)
    with pytest.raises(PlacementError, match="rollout engine 1 needs GPUs 4-5 of the trainer's node, which has 5"):
        placement.engine_devices(1, ["0", "1", "2", "3", "4"])


def test_on_cpu_nothing_is_refused_or_changed():
    placement = make_placement(8, True, _rollout(engine="server", num_engines=4, colocate=True), gpus=0)
    assert not placement.use_gpu and placement.colocate and placement.weight_sync == "distributed"
    assert placement.gpu_share == 1.0 and placement.notes == ()
    assert make_placement(1, False, _rollout(), gpus=0).colocate is False  # unset: nothing to share on a CPU


class _Device:
    def visible(self) -> list[int]:
        return ray.get_gpu_ids()


def test_placement_groups_are_refused_at_their_deadline_and_shared_bundles_share_a_device(monkeypatch):
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert start_ray(num_cpus=2, num_gpus=1) == 1
    try:
        policy = WorkerGroup(_Device, 1, use_gpu=True, share=0.5, name="policy", distributed=False)
        engine = WorkerGroup(_Device, 1, use_gpu=True, share=0.5, name="rollout", distributed=False,
                             shared_group=policy.placement_group)
        assert policy.call("visible") == engine.call("visible") == [[0]]
        with pytest.raises(PlacementError) as refused:  # the GPU is taken: a second one never comes
            WorkerGroup(_Device, 1, use_gpu=True, name="critic", distributed=False, timeout_s=1)
        assert ("critic: 1 bundle(s) of {'GPU': 1, 'CPU': 1} (1 GPU, 1 CPU in all) not free within 1 s "
                "(cluster.placement_timeout_s); the cluster has 1 GPU and 2 CPU, of which 0 GPU") in str(refused.value)
        engine.shutdown()
        policy.shutdown()
        again = WorkerGroup(_Device, 1, use_gpu=True, name="again", distributed=False, timeout_s=30)
        assert again.call("visible") == [[0]]  # the refused group left nothing reserved behind
        again.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement")
    model = build_quickstart_model(root / "model")
    subprocess.run([sys.executable, "-m", "data_preprocess.synthetic_arithmetic", "--out", str(root / "data")],
                   cwd=REPO, check=True, capture_output=True)
    return root, model


def _train(assets, name: str, *overrides: str) -> subprocess.CompletedProcess:
    root, model = assets
    return subprocess.run(
        [sys.executable, "-m", "rl360.cli", "train", "configs/quickstart.yaml", f"output_dir={root / name}",
         f"model.path={model}", f"data.train_files=[{root / 'data' / 'train.parquet'}]", "data.batch_size=4",
         "rollout.n=4", "actor.ppo_mini_batch_size=4", "trainer.total_steps=2", "trainer.save_hf=false",
         "cluster.num_cpus=2", *overrides], cwd=REPO, capture_output=True, text=True, timeout=600,
        env=_declarable_env())


@pytest.mark.slow
def test_the_quickstart_on_one_gpu_runs_its_steps_with_the_engine_colocated(assets):
    result = _train(assets, "one_gpu", "cluster.num_gpus=1")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "placement: 1 of 1 GPU(s): policy 1 for the trainer, the hf engine on policy rank 0's GPU" in result.stdout
    records = [json.loads(line) for line in (assets[0] / "one_gpu" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["rollout/logprob_abs_diff"] <= 1e-6 for r in records)  # the engine got every update


@pytest.mark.slow
def test_colocated_server_engines_on_one_gpu_sync_through_the_host_instead_of_nccl(assets):
    result = _train(assets, "server", "cluster.num_gpus=1", "rollout.engine=server")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "using rollout.weight_sync=tensor" in result.stdout
    records = [json.loads(line) for line in (assets[0] / "server" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["rollout/engines_released"] == 1 for r in records)  # colocated: memory freed for training
    assert all(r["rollout/logprob_abs_diff"] <= 1e-6 for r in records)
    engines = json.loads((assets[0] / "server" / "rollout" / "engines.json").read_text())
    assert [(engine["kind"], engine["gpus"]) for engine in engines] == [("server", "0")]  # the policy's GPU


def test_a_layout_that_does_not_fit_is_refused_in_one_line_before_any_worker_starts(assets):
    result = _train(assets, "refused", "cluster.num_gpus=1", "actor.parallel.data=2")
    assert result.returncode == 2, result.stderr[-4000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "rl360: config error: 2 GPUs needed for the trainer alone (policy 2: actor.parallel tensor x pipeline x "
        "context x data); this cluster has 1: lower actor.parallel.* or add GPUs")
    assert "Traceback" not in result.stderr and "policy layer spec" not in result.stdout


def test_the_memory_check_refuses_a_layout_too_big_for_the_declared_gpu(assets):
    result = _train(assets, "too_big", "cluster.num_gpus=1", "cluster.gpu_memory_gb=1")
    assert result.returncode == 2, result.stderr[-4000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("rl360: config error: the train phase needs ") and "more than 1 GiB" in last, last
    assert "`rl360 plan` prints every term (trainer.memory_check=false to start anyway)" in last
    assert "policy layer spec" not in result.stdout  # refused before any worker started
