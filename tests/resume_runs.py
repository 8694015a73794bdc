"""The runs that tests of resuming share (tests/test_resume.py, tests/test_stopping.py, tests/test_slurm.py): the
tiny quickstart assets, the `rl360 train` command over them, one unbroken run per algorithm to compare interrupted
runs with, and one interrupted run per algorithm: stopped by a signal (GRPO by SIGTERM, PPO by a terminal's Ctrl-C),
then killed once in each phase, each time started again with the same command, and finished. A plugin
(tests/conftest.py), so that its session fixtures run once however many modules use them.
"""

import json
import os
import random
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from rl360.quickstart.assets import build_quickstart_model
from tests.killing import Kill, TrainingProcess, session_pids
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

# the phases each run is killed in (an engine process's generate shows in no Ray title: the async run is killed in
# an update after a checkpoint, when the step after it is drawn from older weights than the checkpoint's; its
# checkpoint writes are those of the others)
RL_PHASES = ("rollout", "update", "checkpoint")  # of tests.killing.PHASES: those of `rl360 train`
KILL_PHASES = {"grpo": RL_PHASES, "ppo": RL_PHASES, ASYNC: ("update",)}
KILL_SEED = 13
MAX_DELAY_S = {"rollout": 0.02, "update": 0.05, "checkpoint": 0.05}  # each lasts ~0.05-1 s here


def _ctrl_c(pid: int) -> None:
    os.killpg(pid, signal.SIGINT)  # a terminal's Ctrl-C: every process of the foreground group


# algorithm -> the signal its run is first stopped by, how it is sent, and the logged step after which it is sent
STOPS = {"grpo": ("SIGTERM", lambda pid: os.kill(pid, signal.SIGTERM), 3), "ppo": ("SIGINT", _ctrl_c, 3)}


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
            f"validation.every={EVAL_EVERY}", "validation.at_end=true", *overrides]


def _finish(runs: dict[str, TrainingProcess]) -> None:
    try:
        for run in runs.values():
            assert run.wait(RUN_TIMEOUT_S) == 0, run.output[-4000:]
    finally:
        for run in runs.values():
            run.kill_everything()


def _another_runs_checkpoints(root: Path) -> dict[str, bytes | None]:
    """Another run's step_000009, step_000010 and `latest` (file contents), and beside them its metrics, saved
    config, log, exported model and held-out samples."""
    out = root.parent
    out.mkdir(parents=True)
    for name in PREVIOUS_RUN_FILES:
        (out / name).write_text(f"the previous run's {name}\n")
    (out / "hf").mkdir()
    (out / "hf" / "model.safetensors").write_bytes(b"the previous run's weights")
    (out / "eval" / "step_000010").mkdir(parents=True)
    (out / "eval" / "step_000010" / "results.jsonl").write_text("the previous run's samples\n")
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


@dataclass
class KillRecord:
    """A kill and what the output directory showed right after it, and the output of the run after it."""

    kill: Kill
    latest: str  # what `latest` named
    partial: list[str]  # `.partial` checkpoint directories
    last_logged: int  # the last step in metrics.jsonl
    next_output: str = ""


@dataclass
class StopRecord:
    """A run stopped by a signal: its exit status and output, the processes of it still alive after it exited,
    and the output of the run after it."""

    signal: str
    code: int
    output: str
    left: list[str]
    next_output: str = ""


@dataclass
class Interrupted:
    out: Path
    stop: StopRecord | None
    kills: list[KillRecord] = field(default_factory=list)
    final_output: str = ""


def _kill_plan(algorithm: str) -> list[tuple[str, int, float]]:
    """(phase, first step to aim at, random delay) per kill: every phase once, in a seeded order."""
    rng = random.Random(f"{KILL_SEED}-{algorithm}")
    phases = list(KILL_PHASES[algorithm])
    rng.shuffle(phases)
    return [(phase, rng.randint(0, 1), rng.uniform(0, MAX_DELAY_S[phase])) for phase in phases]


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _stop(command: list[str], algorithm: str) -> StopRecord:
    name, send, after = STOPS[algorithm]
    run = TrainingProcess(command, cwd=str(REPO))
    try:
        run.wait_for_step(after)
        started = psutil.Process(run.proc.pid).children(recursive=True)
        send(run.proc.pid)
        code = run.wait(RUN_TIMEOUT_S)
        left = [f"{p.pid} {p.name()}" for p in started if _alive(p)] + [str(pid) for pid in session_pids(run.proc.pid)]
    finally:
        run.kill_everything()
    return StopRecord(name, code, run.output, left)


def _interrupt(assets: Path, algorithm: str) -> Interrupted:
    out = assets / f"killed-{algorithm}"
    command = _command(assets, out, algorithm, f"trainer.save_every={SAVE_EVERY}")
    checkpoints = out / "checkpoints"
    run = Interrupted(out, _stop(command, algorithm) if algorithm in STOPS else None)
    resume_step = int((checkpoints / "latest").read_text().strip().removeprefix("step_")) + 1 if run.stop else 1
    for phase, later, delay in _kill_plan(algorithm):
        process = TrainingProcess(command, cwd=str(REPO))
        try:
            # after this process's first checkpoint: every start resumes from a checkpoint its predecessor wrote
            own_checkpoint = -(-resume_step // SAVE_EVERY) * SAVE_EVERY
            kill = process.kill_in(phase, own_checkpoint + 1 + later, delay)
        finally:
            process.kill_everything()
        if run.kills:
            run.kills[-1].next_output = process.output
        elif run.stop:
            run.stop.next_output = process.output
        latest = (checkpoints / "latest").read_text().strip()
        run.kills.append(KillRecord(kill, latest, sorted(p.name for p in checkpoints.glob("*.partial")),
                                    _records(out)[-1]["step"]))
        resume_step = int(latest.removeprefix("step_")) + 1
    final = TrainingProcess(command, cwd=str(REPO))
    _finish({algorithm: final})
    run.kills[-1].next_output = run.final_output = final.output
    return run


@pytest.fixture(scope="session")
def killed(assets) -> dict[str, Interrupted]:
    """Per algorithm, one run stopped by a signal (GRPO, PPO), killed once in each phase and finished; all at
    once."""
    with ThreadPoolExecutor(len(ALGORITHMS)) as pool:
        futures = {algorithm: pool.submit(_interrupt, assets, algorithm) for algorithm in ALGORITHMS}
        return {algorithm: future.result() for algorithm, future in futures.items()}


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
