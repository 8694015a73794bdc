"""End to end on a tiny Qwen2.5-VL: prompts with images streamed from parquet, sampled by `rl360 serve rollout`
(images sent as SGLang's `image_data`), scored, trained by PPO (Megatron policy and critic at TP=2, sequence
parallel, packed micro-batches) and synced back, vision tower included; a run stopped after its checkpoint and
started again ends exactly as the unbroken run."""

import json
import shutil

import pytest
import ray
import torch
from safetensors.torch import load_file

from rl360.config import load_config
from rl360.quickstart.prepare import _script
from rl360.quickstart.vision_assets import build_vision_quickstart_model
from rl360.trainer import train

pytestmark = pytest.mark.slow  # whole training runs (`pytest -m "not slow"` leaves them out)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision_e2e")
    colours = _script("synthetic_colours")
    model = build_vision_quickstart_model(root / "model", texts=[colours.QUESTION], seed=0)
    colours.main(["--out", str(root / "data"), "--train-rows", "16", "--test-rows", "4"])
    return root, model


def _train(assets, out_name: str, steps: int) -> tuple:
    root, model = assets
    cfg = load_config("configs/quickstart_vision.yaml", [
        "configs/algorithms/ppo.yaml",
        f"output_dir={root / out_name}", f"model.path={model}", f"data.train_files=[{root / 'data' / 'train.parquet'}]",
        "data.batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2", f"trainer.total_steps={steps}",
        "trainer.save_every=2", "rollout.engine=server", "actor.parallel.tensor=2", "actor.parallel.sequence=true",
        "actor.pack_sequences=true", "actor.max_tokens_per_micro_batch=400", "trainer.num_threads=1",
        "actor.entropy_coeff=0.01",  # a gradient into every weight at every step, whatever the rewards
    ])
    try:
        out = train(cfg)
    finally:
        ray.shutdown()
    return out, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def unbroken(assets):
    return _train(assets, "unbroken", 3)


@pytest.fixture(scope="module")
def resumed(assets, unbroken):
    """The unbroken run as a run stopped after its step-2 checkpoint leaves it (its checkpoints with `latest` on
    step 2, its first two metric records, its config and log, in a directory of their own), started again."""
    root, _ = assets
    out, _ = unbroken
    again = root / "resumed"
    shutil.copytree(out / "checkpoints", again / "checkpoints")
    (again / "checkpoints" / "latest").write_text("step_000002\n")  # step_000003: removed as written after it
    first_two = (out / "metrics.jsonl").read_text().splitlines(keepends=True)[:2]
    (again / "metrics.jsonl").write_text("".join(first_two))
    for name in ("config.yaml", "train.log"):
        shutil.copy(out / name, again / name)
    return _train(assets, "resumed", 3)


def test_every_step_trains_on_image_prompts_with_engine_and_trainer_in_step(unbroken):
    _, records = unbroken
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert 0.0 <= record["reward/mean"] <= 1.0
        # the engine sampled from the weights the trainer just synced, images and all
        assert record["rollout/logprob_abs_diff"] <= 1e-5, record
        assert "critic/vf_loss" in record


def test_saved_model_has_a_trained_vision_tower_in_hf_names(assets, unbroken):
    _, model = assets
    out, _ = unbroken
    before, after = load_file(f"{model}/model.safetensors"), load_file(out / "hf" / "model.safetensors")
    assert sorted(after) == sorted(before)
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert any(name.startswith("visual.") for name in changed)
    assert any(name.startswith("model.layers.") for name in changed)


def test_a_run_started_again_from_its_checkpoint_ends_as_the_unbroken_run(unbroken, resumed):
    (out, records), (again, resumed_records) = unbroken, resumed
    assert [r["step"] for r in resumed_records] == [1, 2, 3]
    assert "resumed from " + str(again / "checkpoints" / "step_000002") + " at step 3" in \
        (again / "train.log").read_text()
    for ours, theirs in zip(resumed_records, records):  # every metric but the clock's, exactly
        clock = [key for key in theirs if key.startswith("timing/") or key == "weight_sync/seconds"]
        assert {k: v for k, v in ours.items() if k not in clock} == {k: v for k, v in theirs.items() if k not in clock}
    expected, final = load_file(out / "hf" / "model.safetensors"), load_file(again / "hf" / "model.safetensors")
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), name
