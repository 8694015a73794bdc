"""A run stopped after a checkpoint and started again continues exactly where an unbroken run would be."""

import json

import pytest
import ray

from rl360.config import load_config
from rl360.quickstart.assets import build_quickstart_model
from rl360.trainer import train
from tests.test_train_e2e import _row


def _settings(root, out) -> list[str]:
    """Overrides of configs/quickstart.yaml shared by every run here (the model is built once per root)."""
    model = root / "model"
    if not model.exists():
        build_quickstart_model(model)
    return [f"output_dir={out}", f"model.path={model}", f"data.train_files=[{root / 'train.parquet'}]",
            "data.batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2", "trainer.save_hf=false",
            "algorithm.kl_in_reward_coef=0.01", "algorithm.kl_in_reward_target=0.05"]


def _run(root, out, *overrides):
    cfg = load_config("configs/quickstart.yaml", [*_settings(root, out), *overrides])
    try:
        train(cfg)
    finally:
        ray.shutdown()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("estimator", ["grpo", "ppo"])
def test_resumed_run_matches_the_unbroken_run(tmp_path, estimator):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_row(f"{a}+{b}", str(a + b)) for a in range(4) for b in range(3)]  # 12 prompts: epochs roll over
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet", row_group_size=5)
    preset = ["configs/algorithms/ppo.yaml"] if estimator == "ppo" else []
    unbroken = _run(tmp_path, tmp_path / "a", *preset, "trainer.total_steps=5")
    first = _run(tmp_path, tmp_path / "b", *preset, "trainer.total_steps=3", "trainer.save_every=2")
    assert [r["step"] for r in first] == [1, 2, 3]
    assert (tmp_path / "b" / "checkpoints" / "latest").read_text().strip() == "step_000003"  # the last step too
    # a crash after step 3's checkpoint but with step 4 logged: the log is cut back to the checkpoint
    with open(tmp_path / "b" / "metrics.jsonl", "a") as log:
        log.write(json.dumps({"step": 4, "reward/mean": -1.0}) + "\n")
    resumed = _run(tmp_path, tmp_path / "b", *preset, "trainer.total_steps=5", "trainer.save_every=2")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    for ours, theirs in zip(resumed, unbroken):
        assert ours["reward/mean"] == theirs["reward/mean"], ours["step"]
        assert ours["data/epoch"] == theirs["data/epoch"]
        assert ours["reward/kl_coef"] == pytest.approx(theirs["reward/kl_coef"], rel=1e-9)
        assert ours["actor/pg_loss"] == pytest.approx(theirs["actor/pg_loss"], abs=1e-5)
        assert ours["rollout/logprob_abs_diff"] <= 1e-4
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").glob("step_*")) == ["step_000004", "step_000005"]


def test_a_killed_training_process_resumes_where_an_unbroken_run_would_be(tmp_path):
    """`rl360 train` killed with SIGKILL (whatever it was doing: a step, a checkpoint being written), then the
    same command again: the finished run's rewards equal an unbroken run's, step by step."""
    import os
    import signal
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_row(f"{a}+{b}", str(a + b)) for a in range(4) for b in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet", row_group_size=5)
    unbroken = _run(tmp_path, tmp_path / "a", "trainer.total_steps=6")  # in this process
    command = [sys.executable, "-m", "rl360.cli", "train", "configs/quickstart.yaml",
               *_settings(tmp_path, tmp_path / "b"), "trainer.total_steps=6", "trainer.save_every=1"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: Ray and reward workers too
    seen = []
    while not seen or not seen[-1].startswith("step    4"):
        seen.append(proc.stdout.readline())
        assert seen[-1], "".join(seen[-30:])  # the run ended before step 4
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    latest = (tmp_path / "b" / "checkpoints" / "latest").read_text().strip()
    assert latest in ("step_000003", "step_000004")  # step 4's checkpoint may or may not have completed

    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resumed from {tmp_path / 'b' / 'checkpoints' / latest}" in again.stdout
    resumed = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for ours, theirs in zip(resumed, unbroken):
        assert ours["reward/mean"] == theirs["reward/mean"], ours["step"]
        assert ours["actor/pg_loss"] == pytest.approx(theirs["actor/pg_loss"], abs=1e-5)
