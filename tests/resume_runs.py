"""The runs that tests of resuming share (tests/test_resume.py, tests/test_stopping.py): the tiny quickstart assets,
the `rl360 train` command over them, and one unbroken run per algorithm to compare interrupted runs with. A plugin
(tests/conftest.py), so that its session fixtures run once however many modules use them.
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl360.quickstart.assets import build_quickstart_model
from tests.killing import TrainingProcess
from tests.test_train_e2e import _row

REPO = Path(__file__).resolve().parent.parent
# GRPO and PPO with the in-process engine; GRPO sampling a step ahead (async) on an engine process (`rl360 serve
# rollout`), whose kill lands while the engine draws the next step's rollouts beside the update
ASYNC = "grpo-async-server"
ALGORITHMS = {"grpo": [], "ppo": ["configs/algorithms/ppo.yaml"],
              ASYNC: ["rollout.engine=server", "rollout.mode=async", "rollout.weight_sync=tensor"]}
TOTAL_STEPS, SAVE_EVERY = 12, 2
EVAL_EVERY, EVAL_STEPS = 5, [5, 10, 12]  # held-out evaluations: every 5 steps and at the end
RUN_TIMEOUT_S = 600
TIMINGS = ("timing/", "weight_sync/seconds")  # the metrics that measure time, the only ones a kill may change
# An engine process batches the requests that arrive together, and which ones do depends on timing: its log-probs
# round differently in the last bits of fp32 (the sampled tokens, and all training, stay the same). The metrics
# made from them are compared within that rounding on the async run; all others exactly.
ENGINE_LOGPROB_METRICS = ("rollout/logprob_abs_diff", "rollout/logprob_abs_diff_max", "rollout/k3_kl")
ENGINE_BATCHING_TOLERANCE = 1e-6
PREVIOUS_RUN_FILES = ("metrics.jsonl", "config.yaml", "train.log")


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("resume")
    build_quickstart_model(root / "model")
    rows = [_row(f"{a}+{b}", str(a + b)) for a in range(4) for b in range(3)]  # 12 prompts: epochs roll over
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet", row_group_size=5)
    held_out = [_row(f"{a}+{b}", str(a + b)) for a, b in [(5, 1), (6, 2), (7, 0), (0, 7), (1, 5)]]
    held_out += [_row("4+4", "8", source="math__held_out")]  # a second data_source
    pq.write_table(pa.Table.from_pylist(held_out), root / "val.parquet", row_group_size=4)
    return root


def _command(assets: Path, out: Path, algorithm: str, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "rl360.cli", "train", "configs/quickstart.yaml",
            *run_overrides(assets, out, algorithm, *overrides)]


def run_overrides(assets: Path, out: Path, algorithm: str, *overrides: str) -> list[str]:
    """What follows configs/quickstart.yaml on the command line of a run over `assets`."""
    return [*ALGORITHMS[algorithm], f"output_dir={out}", f"model.path={assets / 'model'}",
            f"data.train_files=[{assets / 'train.parquet'}]",
            "data.batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2", "trainer.save_hf=true",
            "rollout.max_response_length=6",  # decoding long enough (~0.05 s) for a kill to land in it
            "algorithm.kl_in_reward_coef=0.01", "algorithm.kl_in_reward_target=0.05",  # adaptive KL: restored too
            f"trainer.total_steps={TOTAL_STEPS}", f"data.val_files=[{assets / 'val.parquet'}]",
            f"trainer.eval_every={EVAL_EVERY}", "trainer.eval_at_end=true", *overrides]


def _finish(runs: dict[str, TrainingProcess]) -> None:
    try:
        for run in runs.values():
            assert run.wait(RUN_TIMEOUT_S) == 0, run.output[-4000:]
    finally:
        for run in runs.values():
            run.kill_everything()


def _another_runs_checkpoints(root: Path) -> dict[str, bytes | None]:
    """Another run's step_000009, step_000010 and `latest` (file contents), and beside them its metrics, saved
    config, log and exported model."""
    out = root.parent
    out.mkdir(parents=True)
    for name in PREVIOUS_RUN_FILES:
        (out / name).write_text(f"the previous run's {name}\n")
    (out / "hf").mkdir()
    (out / "hf" / "model.safetensors").write_bytes(b"the previous run's weights")
    for step in (9, 10):
        (root / f"step_{step:06d}" / "policy").mkdir(parents=True)
        (root / f"step_{step:06d}" / "policy" / "weights").write_bytes(bytes([step]) * 64)
        (root / f"step_{step:06d}" / "trainer.json").write_text(json.dumps({"step": step}))
    (root / "latest").write_text("step_000010\n")
    return _tree(root)


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@dataclass
class Unbroken:
    out: Path
    output: str
    another_run: dict[str, bytes | None]  # what the output directory held before (GRPO's), else {}


@pytest.fixture(scope="session")
def unbroken(assets) -> dict[str, Unbroken]:
    """One unbroken run per algorithm (both at once), checkpointing only at its last step. GRPO's starts over
    (trainer.resume=false) in an output directory that holds another run's checkpoints."""
    another = {algorithm: {} for algorithm in ALGORITHMS}
    another["grpo"] = _another_runs_checkpoints(assets / "unbroken-grpo" / "checkpoints")
    runs = {algorithm: TrainingProcess(_command(assets, assets / f"unbroken-{algorithm}", algorithm,
                                                f"trainer.save_every={TOTAL_STEPS}", "trainer.resume=false",
                                                "tracking.swanlab=true"),
                                       cwd=str(REPO))
            for algorithm in ALGORITHMS}
    _finish(runs)
    return {algorithm: Unbroken(assets / f"unbroken-{algorithm}", run.output, another[algorithm])
            for algorithm, run in runs.items()}


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_same_weights(ours: Path, theirs: Path) -> None:
    """Every tensor of two HF exports equal, bit for bit (same names, dtypes, shapes, values)."""
    mine, other = load_file(str(ours / "model.safetensors")), load_file(str(theirs / "model.safetensors"))
    assert sorted(mine) == sorted(other)
    for name in mine:
        assert mine[name].dtype == other[name].dtype and torch.equal(mine[name], other[name]), name
    assert json.loads((ours / "config.json").read_text()) == json.loads((theirs / "config.json").read_text())


def _assert_same_metrics(ours: Path, theirs: Path, rounded: tuple[str, ...] = ()) -> None:
    """Every step's logged metrics of two runs equal (all but the timings; `rounded` within the engine's batching
    rounding)."""
    mine, other_run = _records(ours), _records(theirs)
    assert [r["step"] for r in mine] == [r["step"] for r in other_run] == list(range(1, TOTAL_STEPS + 1))
    for record, other in zip(mine, other_run):
        compared = {key: value for key, value in record.items() if not key.startswith(TIMINGS)}
        for key in rounded:
            assert compared.pop(key) == pytest.approx(other[key], abs=ENGINE_BATCHING_TOLERANCE), (key, record, other)
        assert compared == {key: value for key, value in other.items()
                            if not key.startswith(TIMINGS) and key not in rounded}, \
            [(key, value, other.get(key)) for key, value in compared.items() if other.get(key) != value]
