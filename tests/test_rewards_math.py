"""The `math` reward: last \\boxed{} after </think>, compared with math-verify under its own time limit."""

import json
import signal
import threading
import time
from pathlib import Path

import pytest

import rl360.rewards.math as math_reward
from rl360.rewards import compute_score, get_reward_fn
from rl360.rewards.math import MathTimeout, last_boxed, time_limit

LABELLED = Path(__file__).parent / "fixtures" / "math_labelled.jsonl"
CATEGORIES = {"integer", "fraction", "decimal", "percent", "radical", "constant", "expression", "equation",
              "interval", "set", "tuple", "complex", "latex-format", "units", "text", "extraction", "malformed"}


def _labelled_cases():
    """The hand-labelled set: one JSON object a line with `response`, `ground_truth`, `label` (1 when a careful
    grader accepts the response's boxed answer, 0 when not; a response without a final \\boxed{} is 0, as
    the prompt asks for one) and `category`."""
    cases = [json.loads(line) for line in LABELLED.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [pytest.param(case, id=f"{number}-{case['category']}") for number, case in enumerate(cases)]


def test_the_labelled_set_is_large_varied_and_well_formed():
    cases = [param.values[0] for param in _labelled_cases()]
    assert len(cases) >= 200
    assert all(set(case) == {"response", "ground_truth", "label", "category"} for case in cases)
    assert {case["category"] for case in cases} == CATEGORIES
    assert {case["label"] for case in cases} == {0, 1}
    assert sum(case["label"] == 0 for case in cases) >= 60  # wrong answers are labelled too
    assert len({(case["response"], case["ground_truth"]) for case in cases}) == len(cases)


@pytest.mark.parametrize("case", _labelled_cases())
def test_math_reward_agrees_with_the_label(case):
    result = compute_score("math__anything", case["response"], case["ground_truth"])
    assert result["score"] == float(case["label"]), case
    assert set(result) == {"score", "pred"}


def test_math_is_registered_for_the_math_prefix():
    assert get_reward_fn("math") is math_reward.stated_math_score
    assert get_reward_fn("math__deepscaler_preview") is math_reward.math_score


def test_a_trajectory_is_scored_on_its_generated_turns_not_its_tool_replies():
    call = '<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>'
    response = call + "\\boxed{3}"  # the decoded response: the call, then the tool's reply (context, not the model's)
    called_only = {"trajectory": {"turns": 2, "turn_texts": [call, ""]}}
    assert compute_score("math__synthetic_tools", response, "3", called_only)["score"] == 0.0
    assert compute_score("math__synthetic_tools", response, "3")["score"] == 1.0  # without a trajectory: all text
    copied = {"trajectory": {"turns": 2, "turn_texts": [call, "\\boxed{3}"]}}
    assert compute_score("math__synthetic_tools", response + "\\boxed{3}", "3", copied)["score"] == 1.0


def test_the_tool_bonus_metric_pays_a_call_only_with_a_right_answer(monkeypatch):
    monkeypatch.delenv("RL360_DEEPEYES_REWARD", raising=False)  # DeepEyes' default tool weight, 1.2
    call = '<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>'

    def score(turns, calls, truth="3"):
        extra = {"reward_metric": "tool_bonus",
                 "trajectory": {"turns": len(turns), "turn_texts": turns, "num_tool_calls": calls}}
        return compute_score("math__synthetic_tools", "".join(turns), truth, extra)

    assert score([call, "\\boxed{3}"], 1) == {"score": 2.2, "acc": 1.0, "pred": "3"}
    assert score([call, "\\boxed{4}"], 1)["score"] == 0.0  # a call with a wrong answer earns nothing
    assert score([call + "\\boxed{3}"], 0) == {"score": 1.0, "acc": 1.0, "pred": "3"}  # a <tool_call> text not run
    assert score(["\\boxed{3}"], 0)["score"] == 1.0


def test_pred_is_the_extracted_box_or_none():
    assert compute_score("math", "x \\boxed{\\frac{1}{2}} y", "0.5")["pred"] == "\\frac{1}{2}"
    assert compute_score("math", "no box", "1")["pred"] is None


@pytest.mark.parametrize("text,expected", [
    ("a \\boxed{\\frac{1}{2}} b", "\\frac{1}{2}"),
    ("\\boxed{a} \\fbox{b}", "b"),
    ("\\fbox{a} \\boxed{b}", "b"),
    ("\\boxed{\\{1\\}}", "\\{1\\}"),
    ("\\boxed{\\left\\{ x \\right\\}}", "\\left\\{ x \\right\\}"),
    ("\\boxed 42 and more", "42"),
    ("\\boxed{a}}", "a"),
    ("nothing", None),
    ("\\boxed", None),
    ("\\boxed{open", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_math_reward_works_outside_the_main_thread():
    # math-verify's own signal-based timeouts would raise ValueError here; ours steps aside
    out = {}
    thread = threading.Thread(target=lambda: out.update(compute_score("math", "\\boxed{\\frac{1}{2}}", "0.5")))
    thread.start()
    thread.join(timeout=60)
    assert out == {"score": 1.0, "pred": "\\frac{1}{2}"}


def test_time_limit_interrupts_a_busy_loop():
    outer = signal.getitimer(signal.ITIMER_REAL)[0]  # pytest-timeout's own timer, when it runs one
    started = time.monotonic()
    with pytest.raises(MathTimeout):
        with time_limit(0.2):
            while time.monotonic() - started < 30:
                pass
    assert time.monotonic() - started < 20
    after = signal.getitimer(signal.ITIMER_REAL)[0]
    assert after == 0.0 if outer == 0.0 else 0.0 < after <= outer  # ours is gone, the caller's is back


def test_time_limit_restores_the_callers_timer_and_handler():
    fired = []

    def outer_handler(signum, frame):
        fired.append(signum)

    previous = signal.signal(signal.SIGALRM, outer_handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 60.0)
        with time_limit(1.0):
            compute_score("math", "\\boxed{2}", "2")
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 30.0 < remaining <= 60.0
        assert signal.getsignal(signal.SIGALRM) is outer_handler
        assert not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_slow_comparison_scores_zero(monkeypatch):
    def slow(pred, truth):
        time.sleep(30)
        return True

    monkeypatch.setattr(math_reward, "is_equiv", slow)
    monkeypatch.setattr(math_reward, "TIMEOUT_S", 0.2)
    started = time.monotonic()
    assert compute_score("math", "\\boxed{1}", "1") == {"score": 0.0, "pred": "1"}
    assert time.monotonic() - started < 20


@pytest.mark.timeout(120)
def test_a_power_tower_is_cut_off_by_the_limit_and_the_next_call_is_fine(monkeypatch, caplog):
    # Without a limit this runs for minutes: sympy works out 9^(9^9), an integer of 370 million digits.
    assert compute_score("math", "\\boxed{x^2+1}", "1+x^2")["score"] == 1.0  # warm: the limit falls in sympy
    monkeypatch.setattr(math_reward, "TIMEOUT_S", 0.5)
    started = time.monotonic()
    assert compute_score("math", "\\boxed{9^{9^{9^{9}}}}", "1") == {"score": 0.0, "pred": "9^{9^{9^{9}}}"}
    assert time.monotonic() - started < 10
    assert "math-verify timed out after 0.5 s" in caplog.text  # a 0 from the limit, not a quick "not equal"
    assert compute_score("math", "so \\boxed{\\frac{1}{2}}", "0.5") == {"score": 1.0, "pred": "\\frac{1}{2}"}
