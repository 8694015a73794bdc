"""A run killed at any point and started again ends exactly where an unbroken run ends: the same weights, bit
for bit (every tensor of the HF export), and the same value of every logged metric (all but the timings; the
engine process's log-prob figures within fp32 rounding) at every step, for GRPO and PPO, and for GRPO sampling a
step ahead on an engine process. A fresh run never touches another run's checkpoints, and the trainer's checkpoints
convert to Hugging Face weights equal to the run's own export.

The kills are real: `rl360 train` runs as a process tree in its own session and is killed with SIGKILL
while a chosen phase runs (rollout, policy update, checkpoint write), seen from outside in Ray's process
titles, after a seeded random delay (tests/killing.py). The titles while the run is frozen, and the
checkpoint directory afterwards, show where each kill landed. The GRPO and PPO runs are first stopped by a
signal (what tests/test_stopping.py checks), so their kills start from the checkpoint a stop wrote. Runs are tiny
(the quickstart model, 4 prompts x 4 samples, 12 steps) and run at once: start-up dominates, and one run keeps
about one core busy.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rl360.checkpointing import latest_checkpoint
from rl360.config import load_config
from rl360.rollout.ahead import restore_ahead
from rl360.tracking.console import dependency_note
from tests.resume_runs import (
    ALGORITHMS,
    ASYNC,
    ENGINE_LOGPROB_METRICS,
    EVAL_STEPS,
    KILL_PHASES,
    PREVIOUS_RUN_FILES,
    REPO,
    RUN_TIMEOUT_S,
    SAVE_EVERY,
    TOTAL_STEPS,
    Unbroken,
    _assert_same_metrics,
    _assert_same_weights,
    _command,
    _records,
    _tree,
)


def test_a_fresh_run_moves_another_runs_checkpoints_aside(unbroken):
    """trainer.resume=false where another run left step_000009, step_000010 and `latest`: that directory is
    moved aside whole, unchanged, and the new run's checkpoints start in a clean one."""
    run = unbroken["grpo"]
    (aside,) = run.out.glob("checkpoints.old-*")
    assert _tree(aside) == run.another_run
    assert f"moved {run.out / 'checkpoints'} aside to {aside}" in run.output
    checkpoints = run.out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", f"step_{TOTAL_STEPS:06d}"]
    assert latest_checkpoint(checkpoints) == checkpoints / f"step_{TOTAL_STEPS:06d}"
    assert [r["step"] for r in _records(run.out)] == list(range(1, TOTAL_STEPS + 1))
    assert not list(unbroken["ppo"].out.glob("checkpoints.old-*"))  # nothing there to move
    for name in PREVIOUS_RUN_FILES:  # the rest of the previous run: moved aside too, and said so
        (aside,) = run.out.glob(f"{name}.old-*")
        assert aside.read_text() == f"the previous run's {name}\n"
        assert f"{name} to {aside.name}" in run.output
    (aside,) = run.out.glob("hf.old-*")
    assert (aside / "model.safetensors").read_bytes() == b"the previous run's weights"
    (aside,) = run.out.glob("eval.old-*")  # its held-out samples too: this run's step 10 is its own
    assert (aside / "step_000010" / "results.jsonl").read_text() == "the previous run's samples\n"
    assert len(_eval_results(run.out, 10)) == 6
    assert "starting over (trainer.resume=false): moved the previous run's metrics.jsonl" in run.output
    assert (run.out / "config.yaml").read_text().startswith(f"output_dir: {run.out}\n")  # this run's own


def test_a_piped_run_shows_k_of_n_and_eta_without_colour_codes_or_repeated_notices(unbroken):
    """The run's output (a pipe): plain text, a step line with k/N, elapsed and ETA per step, megatron's
    Transformer Engine / Apex notice replaced by one line; train.log holds what the console showed."""
    for algorithm, run in unbroken.items():
        assert "\x1b[" not in run.output
        steps = [line for line in run.output.splitlines() if line.startswith("step ")]
        assert [line[:len("step 12/12")] for line in steps] == [f"step {k:>2}/{TOTAL_STEPS}" for k in range(1, 13)]
        assert all(re.fullmatch(r"step +\d+/12  elapsed \d+:\d\d  eta \d+:\d\d  reward=.*", line) for line in steps)
        assert re.match(r"step 12/12  elapsed \d+:\d\d  eta 0:00  ", steps[-1])
        assert "not installed" not in run.output.replace(dependency_note() or "", "")
        assert run.output.count("megatron uses its torch implementations") == (dependency_note() is not None)
        log = (run.out / "train.log").read_text()
        assert "\x1b[" not in log
        lines = run.output.splitlines()
        last_step = max(i for i, line in enumerate(lines) if line.startswith("step "))
        shown = [line for line in lines[:last_step + 1] if line.startswith(("step ", "placement:", "("))]
        if "rollout.engine=server" not in ALGORITHMS[algorithm]:  # the in-process engine's lines, forwarded by Ray
            assert any(line.startswith(("(HFEngine", "(PolicyWorker")) for line in shown), algorithm
        assert all(line in log.splitlines() for line in shown)


def test_async_mode_trains_one_weight_version_behind(unbroken):
    """The async run (one engine process, weights sent as tensors through shared memory): step 1 is sampled from
    the initial weights, every later step from the weights one update behind."""
    metrics = _records(unbroken[ASYNC].out)
    assert [m["step"] for m in metrics] == list(range(1, TOTAL_STEPS + 1))
    assert metrics[0]["rollout/staleness_max"] == 0  # step 1 is sampled from the initial weights
    assert all(m["rollout/staleness_mean"] == m["rollout/staleness_max"] == 1 for m in metrics[1:])
    assert all(m["timing/weight_sync_s"] > 0 and m["reward/calls"] == 16 for m in metrics)  # 4 prompts x 4


def _copy_of(run: Unbroken, tmp_path: Path) -> Path:
    """The run's checkpoints, saved config, metrics and log in a directory of their own, to resume there."""
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(run.out / "checkpoints", out / "checkpoints")
    for name in PREVIOUS_RUN_FILES:
        shutil.copy(run.out / name, out / name)
    return out


def _cli(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=str(REPO), capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          env={key: value for key, value in os.environ.items() if key != "RL360_DEBUG"})


def test_resuming_with_another_dtype_is_refused_naming_it(unbroken, assets, tmp_path):
    out = _copy_of(unbroken["grpo"], tmp_path)
    done = _cli(_command(assets, out, "grpo", f"trainer.total_steps={TOTAL_STEPS + 1}", "model.dtype=bfloat16"))
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) <= 5 and "Traceback" not in done.stderr, lines
    assert lines[-1].startswith(f"rl360: config error: cannot resume {out / 'checkpoints' / 'step_000012'} with "
                                "this config: model.dtype float32 -> bfloat16 (")
    assert not (out / "hf").exists()  # refused before anything ran


def test_resuming_with_another_lr_prints_the_change_and_appends_to_train_log(unbroken, assets, tmp_path):
    out = _copy_of(unbroken["grpo"], tmp_path)
    before = (out / "train.log").read_text()
    stale = out / "eval" / f"step_{TOTAL_STEPS + 1:06d}"  # as a killed attempt at step 13 would have left it
    stale.mkdir(parents=True)
    (stale / "results.jsonl").write_text(json.dumps({"prompt": 0, "sample": 0, "seed": 0, "response": "stale",
                                                     "finish_reason": "stop", "tokens": 1, "error": None}) + "\n")
    done = _cli(_command(assets, out, "grpo", f"trainer.total_steps={TOTAL_STEPS + 1}", "actor.lr=1e-4",
                         "trainer.save_every=0"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    changes = [line for line in done.stdout.splitlines() if line.startswith("resume:")]
    assert changes == ["resume: actor.lr 0.0005 -> 0.0001"]  # total_steps, save_every: not reported
    assert f"resumed from {out / 'checkpoints' / 'step_000012'} at step 13" in done.stdout
    assert [r["step"] for r in _records(out)] == list(range(1, TOTAL_STEPS + 2))
    assert sorted(_evaluations(out)) == [*EVAL_STEPS, TOTAL_STEPS + 1]  # the new last step (validation.at_end) only
    results = _eval_results(out, TOTAL_STEPS + 1)  # the step evaluated again: its directory replaced
    assert len(results) == 6 and "stale" not in [r["response"] for r in results]
    log = (out / "train.log").read_text()
    assert log.startswith(before) and "resume: actor.lr 0.0005 -> 0.0001" in log[len(before):]
    assert "step 13/13" in log[len(before):]


def test_trainer_checkpoints_convert_to_the_runs_own_hf_export(unbroken, tmp_path):
    """`rl360 convert megatron-to-hf` on the trainer's last checkpoint (its checkpoints directory, as a user
    would pass it) gives the weights the run exported at the end, bit for bit. (PPO's policy checkpoint is
    written by the same code; its critic is no language model.)"""

    run = unbroken["grpo"]
    convert = subprocess.run([sys.executable, "-m", "rl360.cli", "convert", "megatron-to-hf", "--ckpt",
                              str(run.out / "checkpoints"), "--out", str(tmp_path / "hf")], cwd=str(REPO),
                             capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert convert.returncode == 0, convert.stdout[-3000:] + convert.stderr[-3000:]
    policy = run.out / "checkpoints" / f"step_{TOTAL_STEPS:06d}" / "policy"
    assert f"wrote Hugging Face checkpoint of {policy} to {tmp_path / 'hf'}" in convert.stdout
    _assert_same_weights(tmp_path / "hf", run.out / "hf")


# ---- held-out evaluation during training -----------------------------------------------------------------

HELD_OUT_QUESTIONS = ["5+1", "6+2", "7+0", "0+7", "1+5", "4+4"]  # val.parquet's prompts, in order
EVAL_SOURCES = {"all": 6, "math__synthetic_arithmetic": 5, "math__held_out": 1}  # data_source -> held-out prompts
EVAL_KEYS = ("prompts", "samples", "accuracy", "pass@1", "maj@1", "response_tokens_mean", "response_tokens_max",
             "response_tokens_median", "truncated_rate", "reward_timeouts", "errors")


def _evaluations(out: Path) -> dict[int, dict[str, float]]:
    """step -> its eval/ metrics, for the steps of metrics.jsonl that have them."""
    found = {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in _records(out)}
    return {step: metrics for step, metrics in found.items() if metrics}


def _eval_results(out: Path, step: int) -> list[dict]:
    """The records of a step's held-out evaluation by (prompt, sample) (written as each finished)."""
    path = out / "eval" / f"step_{step:06d}" / "results.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return sorted(records, key=lambda r: (r["prompt"], r["sample"]))


def test_held_out_evaluations_are_logged_at_their_steps_to_metrics_jsonl_and_swanlab(unbroken):
    """validation.every=5 with validation.at_end over 12 steps: steps 5, 10 and 12 carry eval/<data_source>/<metric>
    and eval/all/<metric> in metrics.jsonl, and swanlab's offline run file holds the same values; each step's
    directory holds its samples and the report those numbers come from, browsable as an `rl360 eval` output."""
    from rl360.eval.during_training import report_metrics
    from rl360.view import open_source
    from tests.test_trackers import _swanlab

    for algorithm, run in unbroken.items():
        evaluations = _evaluations(run.out)
        assert sorted(evaluations) == EVAL_STEPS, algorithm
        assert sorted(p.name for p in (run.out / "eval").glob("step_*")) == [f"step_{s:06d}" for s in EVAL_STEPS]
        for step, metrics in evaluations.items():
            out = run.out / "eval" / f"step_{step:06d}"
            assert report_metrics(json.loads((out / "report.json").read_text())) == metrics
            results = _eval_results(run.out, step)
            seed = load_config(str(REPO / "configs" / "quickstart.yaml")).seed
            assert [(r["prompt"], r["sample"], r["seed"]) for r in results] == \
                [(i, 0, seed + 104_729 + i) for i in range(6)]
            viewed = open_source(out)
            assert viewed.info()["summary"]["prompts_note"] == "" and viewed.info()["total"] == 6
            assert [viewed.row(i)["fields"]["question"] for i in range(6)] == HELD_OUT_QUESTIONS
            assert set(metrics) == {f"eval/{name}/{key}" for name in EVAL_SOURCES for key in EVAL_KEYS}
            for name, prompts in EVAL_SOURCES.items():
                assert metrics[f"eval/{name}/prompts"] == metrics[f"eval/{name}/samples"] == prompts
                accuracy = metrics[f"eval/{name}/accuracy"]
                assert accuracy * prompts == pytest.approx(round(accuracy * prompts))  # 0/1 scores, one greedy each
                assert metrics[f"eval/{name}/pass@1"] == pytest.approx(accuracy)
                assert 1 <= metrics[f"eval/{name}/response_tokens_mean"] <= 6
            assert f"eval at step {step}: 6 held-out prompts x 1  accuracy=" in run.output
        (swanlab,) = _swanlab(run.out)
        logged = {(key, step): value for step, metrics in evaluations.items() for key, value in metrics.items()}
        assert {key: value for key, value in swanlab.items() if key[0].startswith("eval/")} == logged, algorithm


def test_a_held_out_evaluation_scores_what_the_policy_answers_greedily(unbroken, assets):
    """The last evaluation (greedy, one sample) equals decoding the run's exported weights greedily with
    transformers and scoring each answer with the data_source's reward."""
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl360.data import PromptRenderer
    from rl360.rewards import compute_score

    run = unbroken["grpo"]
    tokenizer = AutoTokenizer.from_pretrained(run.out / "hf")
    model = AutoModelForCausalLM.from_pretrained(run.out / "hf", torch_dtype=torch.float32)
    renderer = PromptRenderer(tokenizer, 32)
    scores: dict[str, list[float]] = {}
    for row in pq.read_table(assets / "val.parquet").to_pylist():
        ids = torch.tensor([renderer.render(row["prompt"])])
        out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        score = compute_score(row["data_source"], text, row["reward_model"]["ground_truth"])
        scores.setdefault(row["data_source"], []).append(score["score"] if isinstance(score, dict) else score)
    scores["all"] = [score for name in list(scores) for score in scores[name]]
    last = _evaluations(run.out)[TOTAL_STEPS]
    assert {name: last[f"eval/{name}/accuracy"] for name in scores} == \
        {name: pytest.approx(sum(values) / len(values)) for name, values in scores.items()}


# ---- killed runs ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_each_kill_landed_in_the_phase_it_aimed_at(killed, algorithm):
    """The titles while frozen show the phase; the output directory agrees: a kill while a checkpoint was
    written left its `.partial` directory (the step it logged last) with `latest` on an older one; a kill in a
    rollout or an update left none, the step not yet logged. The next start resumed from `latest` and removed
    the partial directory."""
    run = killed[algorithm]
    assert sorted(record.kill.phase for record in run.kills) == sorted(KILL_PHASES[algorithm])
    for record in run.kills:
        kill = record.kill
        assert kill.landed_in_phase, (kill.phase, kill.titles)
        latest_step = int(record.latest.removeprefix("step_"))
        if kill.phase == "checkpoint":
            assert record.partial == [f"step_{record.last_logged:06d}.partial"], record
            assert latest_step < record.last_logged, record
            assert f"removing {run.out / 'checkpoints' / record.partial[0]}" in record.next_output
        else:
            assert record.partial == [], record
            assert latest_step <= record.last_logged, record
        assert f"resumed from {run.out / 'checkpoints' / record.latest} at step {latest_step + 1}" \
            in record.next_output, record.next_output[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_killed_run_ends_exactly_as_the_unbroken_run(killed, unbroken, algorithm):
    """Async: every start after a kill trained first on the step drawn ahead before its checkpoint, kept there."""
    run, reference = killed[algorithm], unbroken[algorithm]
    for record in run.kills:
        kept = f"resume: step {int(record.latest.removeprefix('step_')) + 1} trains on the rollouts drawn " \
               f"before {record.latest}"
        assert (kept in record.next_output) == (algorithm == ASYNC), record.next_output[-3000:]
    assert sorted(_evaluations(run.out)) == EVAL_STEPS  # evaluated where the unbroken run did, each step once
    for step in EVAL_STEPS:  # each step's samples those of the unbroken run (a step evaluated again replaced them)
        ours, theirs = _eval_results(run.out, step), _eval_results(reference.out, step)
        if algorithm == ASYNC:  # greedy decoding beside other steps' requests: batching may round a near tie apart
            ours, theirs = [(r["prompt"], r["sample"]) for r in ours], [(r["prompt"], r["sample"]) for r in theirs]
        assert ours == theirs, step
    _assert_same_metrics(run.out, reference.out, ENGINE_LOGPROB_METRICS if algorithm == ASYNC else ())
    _assert_same_weights(run.out / "hf", reference.out / "hf")


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_resumed_run_leaves_only_complete_checkpoints(killed, algorithm):
    checkpoints = killed[algorithm].out / "checkpoints"
    last_two = [f"step_{TOTAL_STEPS - SAVE_EVERY:06d}", f"step_{TOTAL_STEPS:06d}"]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", *last_two]
    assert all((checkpoints / name / "trainer.json").is_file() for name in last_two)
    assert not list(killed[algorithm].out.glob("checkpoints.old-*"))  # every start resumed: nothing set aside


@pytest.mark.slow
def test_kept_rollouts_are_drawn_again_under_a_config_that_changes_them(killed):
    """The async run's checkpoint before its last step keeps that step's rollouts, drawn before it: a resume under
    the run's config gets them and the stream position after their prompts; one that changes how rollouts are
    drawn (rollout.n) gets none, the position before them, and a line naming the change."""
    out = killed[ASYNC].out
    checkpoint = out / "checkpoints" / f"step_{TOTAL_STEPS - SAVE_EVERY:06d}"
    before = json.loads((checkpoint / "trainer.json").read_text())["data"]
    same = load_config(out / "config.yaml")
    pending, data, note = restore_ahead(checkpoint, same, before)
    assert sorted(pending) == [TOTAL_STEPS - SAVE_EVERY + 1] and data != before
    assert note == f"resume: step {TOTAL_STEPS - SAVE_EVERY + 1} trains on the rollouts drawn before {checkpoint.name}"
    kept = pending[TOTAL_STEPS - SAVE_EVERY + 1].result()
    assert len(kept.scored.samples) == 16 and kept.data_before == before
    assert {sample.weight_version for sample in kept.scored.samples} == {TOTAL_STEPS - SAVE_EVERY - 1}
    changed = load_config(out / "config.yaml", ["rollout.n=2"])
    assert restore_ahead(checkpoint, changed, before) == (
        {}, before, f"resume: the rollouts of step {TOTAL_STEPS - SAVE_EVERY + 1} kept in {checkpoint.name} are "
                    "drawn again from its weights (rollout.n 4 -> 2)")
    last = out / "checkpoints" / f"step_{TOTAL_STEPS:06d}"  # nothing ahead of the last step
    assert restore_ahead(last, same, {"position": 0}) == ({}, {"position": 0}, None)
