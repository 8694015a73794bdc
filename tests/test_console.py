"""The run's console and output directory: the config saved and compared on resume, the previous run moved aside
when starting over, step lines with k/N, elapsed and ETA, train.log, user errors raised in Ray workers reported
as one line, `rl360 --version`. (Whole runs: tests/test_resume.py.)"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import ray

import rl360
from rl360.checkpointing import set_previous_run_aside
from rl360.config import ConfigError, RunConfig, to_dict
from rl360.errors import run_command, user_error_in
from rl360.run_config import check_resume, resume_changes, save_run_config, saved_run_config
from rl360.tracking import tracker as tracker_module
from rl360.tracking.console import RunLog, format_duration, quiet_known_warnings
from rl360.tracking.tracker import Tracker

REPO = Path(__file__).resolve().parents[1]


def _cfg(**sections) -> RunConfig:
    cfg = RunConfig(output_dir="/runs/a")
    for name, changes in sections.items():
        cfg = replace(cfg, **{name: replace(getattr(cfg, name), **changes)})
    return cfg


# ----- what a resumed run may change ----------------------------------------------------------------------------


def test_resume_refuses_what_a_checkpoint_cannot_take_and_lists_the_rest():
    saved = to_dict(_cfg(actor={"lr": 5e-4}))
    changed = _cfg(model={"dtype": "bfloat16", "path": "/models/other"}, data={"batch_size": 8}, rollout={"n": 4},
                   actor={"lr": 1e-4, "distributed_optimizer": True})
    refused, allowed = resume_changes(saved, to_dict(changed))
    assert [line.split(" (")[0] for line in refused] == ['model.path "" -> /models/other',
                                                         "model.dtype float32 -> bfloat16",
                                                         "actor.distributed_optimizer false -> true"]
    assert allowed == ["data.batch_size 16 -> 8", f"rollout.n {RunConfig().rollout.n} -> 4",
                       "actor.lr 0.0005 -> 0.0001"]


def test_a_critic_added_or_dropped_is_refused_another_estimator_resumes():
    grpo = to_dict(_cfg())
    refused, _ = resume_changes(grpo, to_dict(_cfg(algorithm={"adv_estimator": "gae"})))
    assert refused == ["algorithm.adv_estimator grpo -> gae (the checkpoint has no critic; this run needs one)"]
    refused, _ = resume_changes(to_dict(_cfg(algorithm={"adv_estimator": "gae"})), grpo)
    assert refused == ["algorithm.adv_estimator gae -> grpo (the checkpoint holds a critic; this run has none)"]
    assert resume_changes(grpo, to_dict(_cfg(algorithm={"adv_estimator": "rloo"}))) == \
        ([], ["algorithm.adv_estimator grpo -> rloo"])


def test_layout_changes_resume_and_run_length_logging_and_paths_are_not_reported():
    saved = to_dict(_cfg())
    other = _cfg(actor={"parallel": replace(RunConfig().actor.parallel, tensor=2, data=2)},
                 trainer={"total_steps": 7, "save_every": 3, "resume": False}, tracking={"wandb": True},
                 cluster={"num_cpus": 3})
    other = replace(other, output_dir="/runs/b")
    assert resume_changes(saved, to_dict(other)) == ([], ["actor.parallel.tensor 1 -> 2", "actor.parallel.data 1 -> 2"])


def test_a_mapping_valued_key_is_one_value_and_keys_the_saved_config_lacks_are_skipped():
    saved = to_dict(_cfg())
    del saved["agent"]  # a config saved by a version without these keys
    now = _cfg(reward={"custom": {"mytask": "my_rewards:score"}}, agent={"max_turns": 9})
    assert resume_changes(saved, to_dict(now)) == ([], ["reward.custom {} -> {'mytask': 'my_rewards:score'}"])


def test_check_resume_reads_the_saved_config_and_refuses_in_one_line(tmp_path):
    save_run_config(tmp_path, _cfg(actor={"lr": 5e-4}))
    saved = saved_run_config(tmp_path)
    assert saved["actor"]["lr"] == 5e-4 and saved["model"]["dtype"] == "float32"
    assert resume_changes(saved, to_dict(_cfg(actor={"lr": 5e-4}))) == ([], [])  # YAML round trip: every value
    checkpoint = tmp_path / "checkpoints" / "step_000004"
    assert check_resume(tmp_path, _cfg(actor={"lr": 1e-4}), checkpoint) == ["resume: actor.lr 0.0005 -> 0.0001"]
    with pytest.raises(ConfigError) as refused:
        check_resume(tmp_path, _cfg(actor={"lr": 1e-4}, model={"dtype": "bfloat16"}), checkpoint)
    message = str(refused.value)
    assert "\n" not in message and "model.dtype float32 -> bfloat16" in message and "actor.lr" not in message
    assert str(checkpoint) in message and "trainer.resume=false" in message


def test_a_run_without_a_saved_config_resumes_and_says_so(tmp_path):
    (note,) = check_resume(tmp_path, _cfg(), tmp_path / "checkpoints" / "step_000002")
    assert note.startswith(f"resume: {tmp_path / 'config.yaml'} not found")


def test_a_damaged_saved_config_is_a_config_error_naming_it(tmp_path):
    (tmp_path / "config.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "config.yaml"))):
        saved_run_config(tmp_path)


def test_starting_over_moves_the_previous_runs_files_aside(tmp_path):
    for name in ("metrics.jsonl", "config.yaml", "train.log"):
        (tmp_path / name).write_text(name)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "unrelated.txt").write_text("stays")
    (line,) = set_previous_run_aside(tmp_path, resume=False)
    assert line.startswith("starting over (trainer.resume=false): moved the previous run's metrics.jsonl to "
                           "metrics.jsonl.old-")
    assert sorted(p.name.split(".old-")[0] for p in tmp_path.glob("*.old-*")) == \
        ["config.yaml", "hf", "metrics.jsonl", "train.log"]
    (hf,) = tmp_path.glob("hf.old-*")
    assert (hf / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in tmp_path.iterdir() if ".old-" not in p.name) == ["unrelated.txt"]
    assert set_previous_run_aside(tmp_path, resume=True) == []  # nothing left to move


# ----- the console ---------------------------------------------------------------------------------------------


def test_step_lines_show_k_of_n_elapsed_and_an_eta_from_the_steps_after_the_first(tmp_path, monkeypatch):
    clock = iter([100.0, 130.0, 132.0, 134.0])  # start; then the end of steps 1, 2, 3
    monkeypatch.setattr(tracker_module.time, "monotonic", lambda: next(clock))
    console = io.StringIO()
    tracker = Tracker(tmp_path, {}, console=console, total_steps=12)
    for step in (1, 2, 3):
        tracker.log(step, {"reward/mean": 0.5, "timing/step_s": 3.0 if step == 1 else 2.0})
    tracker.close()
    lines = console.getvalue().splitlines()
    assert [line.split("  reward")[0] for line in lines] == [
        "step  1/12  elapsed 0:30  eta 0:33",  # one step: its own 3 s (not the start-up before it) x 11
        "step  2/12  elapsed 0:32  eta 0:20",  # 2 s a step since the first x 10
        "step  3/12  elapsed 0:34  eta 0:18"]


def test_step_zero_an_evaluation_before_training_shows_no_eta_and_times_no_step(tmp_path, monkeypatch):
    clock = iter([100.0, 120.0, 130.0, 132.0])  # start; the evaluation before training; steps 1 and 2
    monkeypatch.setattr(tracker_module.time, "monotonic", lambda: next(clock))
    console = io.StringIO()
    tracker = Tracker(tmp_path, {}, console=console, total_steps=12)
    tracker.log(0, {"eval/all/accuracy": 0.25})
    for step in (1, 2):
        tracker.log(step, {"reward/mean": 0.5, "timing/step_s": 3.0 if step == 1 else 2.0})
    tracker.close()
    assert [line.split("  reward")[0].rstrip() for line in console.getvalue().splitlines()] == [
        "step  0/12  elapsed 0:20",
        "step  1/12  elapsed 0:30  eta 0:33",  # step 1's own 3 s x 11, as without the evaluation
        "step  2/12  elapsed 0:32  eta 0:20"]


def test_format_duration():
    assert [format_duration(s) for s in (0, 59.6, 61, 3599, 3600, 86399)] == \
        ["0:00", "1:00", "1:01", "59:59", "1:00:00", "23:59:59"]


def test_run_log_copies_stdout_and_stderr_without_colour_codes_and_appends(tmp_path, capsys):
    path = tmp_path / "train.log"
    with RunLog(path):
        print("\x1b[36m(PolicyWorker pid=1)\x1b[0m hello")
        print("oops", file=sys.stderr)
    with RunLog(path):
        print("resumed")
    assert path.read_text() == "(PolicyWorker pid=1) hello\noops\nresumed\n"
    shown = capsys.readouterr()
    assert shown.out == "\x1b[36m(PolicyWorker pid=1)\x1b[0m hello\nresumed\n" and shown.err == "oops\n"
    with pytest.raises(ConfigError), RunLog(path):
        raise ConfigError("data row 3: no prompt")
    ending = path.read_text().removeprefix("(PolicyWorker pid=1) hello\noops\nresumed\n")
    assert ending.startswith("Traceback") and ending.endswith("rl360.errors.ConfigError: data row 3: no prompt\n"
                                                              "rl360: config error: data row 3: no prompt\n")
    assert capsys.readouterr() == ("", "")  # the console shows it as the command line reports it


def test_known_notices_are_filtered_here_and_in_processes_started_later(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "default::DeprecationWarning")
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        quiet_known_warnings()
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", stacklevel=1)
        warnings.warn("something else", stacklevel=1)
    assert [str(w.message) for w in caught] == ["something else"]
    child = subprocess.run([sys.executable, "-c", "import warnings; warnings.warn('Apex is not installed. Fall "
                            "back'); warnings.warn('other')"], capture_output=True, text=True, env=os.environ.copy())
    assert "Apex" not in child.stderr and "other" in child.stderr
    assert os.environ["PYTHONWARNINGS"].startswith("default::DeprecationWarning,")


def test_version():
    done = subprocess.run([sys.executable, "-m", "rl360.cli", "--version"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and done.stdout == f"rl360 {rl360.__version__}\n"


# ----- user errors raised in Ray workers ---------------------------------------------------------------------------


@ray.remote(num_cpus=0)
class _Refuser:
    def __init__(self, refuse_at_start: bool = False):
        if refuse_at_start:
            raise ConfigError("reward.custom.mytask: my_rewards has no score function")

    def row(self, index: int) -> None:
        raise ConfigError(f"data row {index}: reward_model.ground_truth is null")

    def bug(self) -> None:
        raise KeyError("internal")


@pytest.fixture(scope="module")
def local_ray():
    """A Ray of this module's own that does not forward its workers' logs (a Ray an earlier module on this worker
    left running may, and its forwarded lines would mix with the one line checked here)."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def _call(remote, wrap: bool = False):
    def run(_):
        try:
            return ray.get(remote)
        except Exception as err:
            if wrap:  # as rl360.cluster.groups.WorkerGroup reports a dead rank
                raise RuntimeError(f"policy rank 0 died: {err}") from err
            raise
    return run


def test_a_user_error_raised_in_a_ray_worker_is_one_line(local_ray, capsys, monkeypatch):
    monkeypatch.delenv("RL360_DEBUG", raising=False)
    actor = _Refuser.remote()
    assert run_command(_call(actor.row.remote(7)), None) == 2
    assert capsys.readouterr().err == "rl360: config error: data row 7: reward_model.ground_truth is null\n"

    refusing = _Refuser.remote(True)  # its __init__ raises: Ray reports it as text on every later call
    assert run_command(_call(refusing.row.remote(1), wrap=True), None) == 2
    assert capsys.readouterr().err == "rl360: config error: reward.custom.mytask: my_rewards has no score function\n"

    with pytest.raises(ray.exceptions.RayTaskError):  # a bug in a worker keeps its traceback
        run_command(_call(actor.bug.remote()), None)
    assert user_error_in(RuntimeError("plain")) is None
