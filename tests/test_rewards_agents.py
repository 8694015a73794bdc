"""Rewards of tool-using agents (DeepEyes', PyVision's) against a real judge server, and the trajectory summary that
reaches reward functions through the reward pool's worker processes."""

import pickle
import threading

import pytest

from rl360.agents.loop import AgentSample, AgentTrace, CallRecord, TurnRecord
from rl360.config import DeepEyesRewardConfig, JudgeConfig
from rl360.core.trajectory import Sample, TrajectorySummary, Turn
from rl360.rewards import RewardItem, RewardPool, register_reward_path
from rl360.rewards.agentic import deepeyes_env
from rl360.rewards.judge import judge_env
from tests.test_judge import JudgeServer

QUESTION = {"question": "What is written on the sign?"}


@pytest.fixture(scope="module")
def judge():
    server = JudgeServer()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


def _env(judge, weights=None):
    env = judge_env(JudgeConfig(url=judge.base_url, model="judge-model", timeout_s=5.0, backoff_s=0.01))
    return {**env, **deepeyes_env(weights or DeepEyesRewardConfig())}


@pytest.fixture(scope="module")
def pool(judge):
    with RewardPool(num_workers=2, timeout_s=30, env=_env(judge)) as reward_pool:
        yield reward_pool


def _trajectory(*turn_texts, calls=0, errors=0):
    return TrajectorySummary(turns=len(turn_texts), turn_texts=turn_texts,
                             tool_calls={"image_zoom_in": calls} if calls else {}, tool_errors=errors)


ZOOM = '<think>too small to read</think>\n<tool_call>{"name": "image_zoom_in", "arguments": {}}</tool_call>'


def _judged(judge):
    return len(judge.bodies)


def test_deepeyes_reward_pays_the_tool_only_with_a_right_answer(judge, pool):
    cases = [  # (trajectory, response text, expected score)
        (_trajectory(ZOOM, "<think>now legible</think><answer>STOP</answer>", calls=1), 0.8 + 1.2),
        (_trajectory("<think>legible</think><answer>STOP</answer>"), 0.8),
        (_trajectory(ZOOM, "<think>hm</think><answer>WRONG</answer>", calls=1), 0.0),
        # the answer tags unbalanced in the last turn: -0.2 for the format, the answer still judged
        (_trajectory(ZOOM, "<think>a</think><answer>STOP</answer></answer>", calls=1), 0.8 - 0.2 + 1.2),
        # an unclosed <think>
        (_trajectory("<think>a <answer>STOP</answer>"), 0.8 - 0.2),
        # no <answer> at all: the last turn's text is judged, and the format costs 0.2
        (_trajectory("<think>a</think>STOP"), 0.8 - 0.2),
    ]
    items = [RewardItem("vstar", "\n".join(t.turn_texts), "STOP", dict(QUESTION), t) for t, _ in cases]
    results = pool.score(items)
    assert [r.error for r in results] == [None] * len(cases)
    assert [r.score for r in results] == pytest.approx([expected for _, expected in cases])
    assert [r.extras["acc"] for r in results] == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0]


def test_deepeyes_reads_the_generated_turns_not_the_tool_replies(judge, pool):
    """A tool reply that holds an <answer> (or an unbalanced tag) is in the response text but not the model's."""
    trajectory = _trajectory(ZOOM, "<think>ok</think><answer>STOP</answer>", calls=1)
    text = ZOOM + "\n<tool_response>\n<answer>WRONG</answer> <think>\n</tool_response>\n" + trajectory.turn_texts[1]
    result, = pool.score([RewardItem("chart", text, "STOP", dict(QUESTION), trajectory)])
    assert result.score == pytest.approx(2.0) and result.extras["answer"] == "STOP"
    # without a trajectory the text is one turn and a <tool_call> in it counts as tool use
    plain, = pool.score([RewardItem("chart", ZOOM + "<answer>STOP</answer>", "STOP", dict(QUESTION))])
    assert plain.score == pytest.approx(2.0)


def test_a_long_answer_scores_no_accuracy_and_is_not_judged(judge, pool):
    before = _judged(judge)
    result, = pool.score([RewardItem("vstar", "<answer>" + "STOP " * 250 + "</answer>", "STOP", dict(QUESTION),
                                     _trajectory("<answer>" + "STOP " * 250 + "</answer>"))])
    assert result.score == pytest.approx(-0.2) and result.extras["acc"] == 0.0
    assert _judged(judge) == before


def test_deepeyes_weights_come_from_the_config(judge):
    weights = DeepEyesRewardConfig(accuracy_weight=1.0, format_weight=0.5, tool_weight=0.25)
    with RewardPool(num_workers=1, timeout_s=30, env=_env(judge, weights)) as pool:
        results = pool.score([
            RewardItem("vstar", "", "STOP", dict(QUESTION), _trajectory(ZOOM, "<answer>STOP</answer>", calls=1)),
            RewardItem("vstar", "", "STOP", dict(QUESTION), _trajectory("<think>STOP")),
        ])
    assert [r.score for r in results] == pytest.approx([1.0 + 0.25, 1.0 - 0.5])


def test_pyvision_reward_is_the_judge_verdict_alone(judge, pool):
    before = _judged(judge)
    cases = [("<answer>STOP</answer>", 1.0), ("<answer>WRONG</answer>", 0.0)]
    results = pool.score([RewardItem("deepeyes", text, "STOP", dict(QUESTION), _trajectory("x", text, calls=3))
                          for text, _ in cases])
    assert [r.score for r in results] == [1.0, 0.0] and [r.error for r in results] == [None, None]
    assert _judged(judge) == before + 2
    refused = ["no answer", "<answer><interpreter>1</interpreter></answer>", "<answer>\\boxed{STOP}</answer>",
               "<answer>" + "x" * 1000 + "</answer>"]
    results = pool.score([RewardItem("zebra_cot", text, "STOP", dict(QUESTION)) for text in refused])
    assert [r.score for r in results] == [0.0] * 4 and [r.error for r in results] == [None] * 4
    assert _judged(judge) == before + 2  # none of them asked the judge
    # a DeepEyes data_source under PyVision's reward_metric
    result, = pool.score([RewardItem("vstar", "<answer>STOP</answer>", "STOP",
                                     {**QUESTION, "reward_metric": "pyvision"}, _trajectory("<answer>STOP</answer>"))])
    assert result.score == 1.0 and "tool_reward" not in result.extras


def test_a_failed_judgement_is_a_counted_error(judge, pool):
    result, = pool.score([RewardItem("vstar", "<answer>STOP</answer>", "STOP",
                                     {"question": "TAG=bad_request read it"})])
    assert result.score == 0.0 and "http_400" in result.error
    missing, = pool.score([RewardItem("deepeyes", "<answer>STOP</answer>", "STOP", {})])
    assert "extra_info needs 'question'" in missing.error


def summary_score(solution_str, ground_truth, extra_info=None):
    """A reward that reports what it was told of the trajectory."""
    trajectory = extra_info["trajectory"]
    return {"score": float(trajectory["num_tool_calls"]), "turns": trajectory["turns"],
            "texts": trajectory["turn_texts"], "errors": trajectory["tool_errors"], "ended_by": trajectory["ended_by"],
            "row": extra_info.get("row")}


def one_turn_trajectory_seen(solution_str, ground_truth, extra_info=None):
    """1 when the reward got the sample's trajectory: one generated turn, its text the response, no tool call (the
    agent-loop training run in tests/test_agents.py, whose random model calls no tool)."""
    trajectory = (extra_info or {}).get("trajectory") or {}
    return float(trajectory.get("turns") == 1 and trajectory.get("num_tool_calls") == 0
                 and trajectory.get("turn_texts") == [solution_str])


def test_an_agent_samples_summary_reaches_the_reward_worker():
    """AgentSample -> TrajectorySummary (generated turns decoded, calls by tool, errors) -> a worker process."""
    generated_a, tool, generated_b = [1, 2], [7, 7, 7], [3]
    base = Sample([0], generated_a + tool + generated_b, [0.0] * 6, "stop", loss_mask=[1, 1, 0, 0, 0, 1],
                  turns=[Turn(0, 2), Turn(2, 5, generated=False), Turn(5, 6)])
    calls = (CallRecord("python"), CallRecord("python", error="boom"), CallRecord("image_zoom_in", timed_out=True))
    trace = AgentTrace((TurnRecord(2, "stop", calls, 3), TurnRecord(1, "stop")), "done")
    sample = AgentSample(**{name: getattr(base, name) for name in Sample.__dataclass_fields__}, trace=trace)
    summary = sample.summary(lambda ids: "|".join(map(str, ids)))
    assert summary == TrajectorySummary(2, ("1|2", "3"), {"python": 2, "image_zoom_in": 1}, 2, 1, "done")
    assert len(pickle.dumps(summary)) < 1000
    assert Sample([0], [4, 5], [0.0, 0.0], "length").summary(str).turn_texts == ("[4, 5]",)

    register_reward_path("agent_summary_test", "tests.test_rewards_agents:summary_score", exact=True)
    with RewardPool(num_workers=1, timeout_s=30) as pool:
        result, = pool.score([RewardItem("agent_summary_test", "text", "", {"row": 7}, summary)])
    assert result.error is None and result.score == 3.0
    assert result.extras == {"turns": 2, "texts": ["1|2", "3"], "errors": 2, "ended_by": "done", "row": 7}
