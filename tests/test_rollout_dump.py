"""`trainer.dump_rollouts_every`: a step's trajectories trained on, as JSON lines with their text, scores and the
per-token |trainer - engine| log-prob difference over the trained tokens."""

import json

import pytest
import torch

from rl360.actor.batch import build_batch
from rl360.core import Sample
from rl360.core.trajectory import Turn
from rl360.tracking.rollout_dump import due, dump_rollouts


def _decode(ids):
    return " ".join(f"t{i}" for i in ids)


@pytest.fixture
def step_rollouts():
    one_turn = Sample([1, 2], [5, 6, 7], [-0.5, -0.25, -1.0], "stop", weight_version=3)
    dropped = Sample([1, 3], [8], [-0.1], "length", weight_version=3)
    # an agent's trajectory: a generated turn, a tool's reply (not trained on), another generated turn
    agent = Sample([4], [9, 10, 11, 12], [-0.2, 0.0, 0.0, -0.4], "stop", weight_version=2,
                   loss_mask=[1, 0, 0, 1], turns=[Turn(0, 1, 2), Turn(1, 3, generated=False), Turn(3, 4, 3)])
    samples = [one_turn, dropped, agent]
    rows = [{"data_source": "openai/gsm8k"}, {"data_source": "openai/gsm8k"}, {"data_source": "tools"}]
    keep = torch.tensor([True, False, True])
    kept = [samples[0], samples[2]]
    batch = build_batch([s.prompt_ids for s in kept], [s.response_ids for s in kept], [s.logprobs for s in kept],
                        pad_id=0, loss_masks=[s.loss_mask for s in kept])
    batch.old_logprobs = batch.rollout_logprobs + torch.tensor([[0.125, -0.25, 0.5, 0.0], [-0.0625, 7.0, 7.0, 0.25]])
    return samples, rows, torch.tensor([1.0, 0.0]), batch, keep


def test_each_kept_trajectory_is_a_line_with_its_text_score_and_logprob_difference(tmp_path, step_rollouts):
    samples, rows, scores, batch, keep = step_rollouts
    path = dump_rollouts(tmp_path, 12, samples, rows, scores, batch, _decode, keep)
    assert path == tmp_path / "rollouts" / "step_000012.jsonl"
    first, agent = [json.loads(line) for line in path.read_text().splitlines()]
    assert first == {"index": 0, "data_source": "openai/gsm8k", "prompt": "t1 t2", "response": "t5 t6 t7",
                     "score": 1.0, "response_length": 3, "finish_reason": "stop", "weight_version": 3,
                     "response_tokens": ["t5", "t6", "t7"],
                     "logprob_diff": [0.125, 0.25, 0.5], "logprob_diff_mean": pytest.approx(0.875 / 3),
                     "logprob_diff_max": 0.5}
    # the tool's tokens carry no difference (their engine log-prob is no sample's); the padding none at all
    assert [value is None for value in agent["logprob_diff"]] == [False, True, True, False]
    assert [agent["logprob_diff"][i] for i in (0, 3)] == pytest.approx([0.0625, 0.25], abs=1e-6)  # fp32 sums
    assert agent["logprob_diff_mean"] == pytest.approx(0.15625) and agent["logprob_diff_max"] == pytest.approx(0.25)
    assert (agent["data_source"], agent["score"], agent["response_length"]) == ("tools", 0.0, 4)
    assert agent["turns"] == [{"text": "t9", "generated": True, "version": 2},
                              {"text": "t10 t11", "generated": False, "version": 0},
                              {"text": "t12", "generated": True, "version": 3}]
    assert agent["trajectory"]["turns"] == 2 and agent["trajectory"]["ended_by"] == "done"
    assert "turns" not in first


def test_a_rerun_step_rewrites_its_file_and_every_n_steps_are_due(tmp_path, step_rollouts):
    samples, rows, scores, batch, keep = step_rollouts
    dump_rollouts(tmp_path, 4, samples, rows, scores, batch, _decode, keep)
    path = dump_rollouts(tmp_path, 4, samples, rows, torch.tensor([0.5, 0.5]), batch, _decode, keep)
    assert [json.loads(line)["score"] for line in path.read_text().splitlines()] == [0.5, 0.5]
    assert [p.name for p in (tmp_path / "rollouts").iterdir()] == ["step_000004.jsonl"]
    assert [step for step in range(1, 10) if due(3, step)] == [3, 6, 9]
    assert not any(due(0, step) for step in range(1, 10))


def test_per_token_differences_are_dumped_as_computed_not_rounded():
    """fp32 differences of 1e-7 are what a healthy run shows: the per-token list keeps them, as the mean does."""
    from rl360.tracking.rollout_dump import _logprob_diff

    diff = torch.tensor([3e-8, 1.5e-7, 0.0])
    dumped = _logprob_diff(diff, torch.tensor([1.0, 1.0, 0.0]), 3)
    assert dumped["logprob_diff"] == [float(diff[0]), float(diff[1]), None]
    assert dumped["logprob_diff_mean"] == pytest.approx(sum(dumped["logprob_diff"][:2]) / 2, rel=1e-6)
