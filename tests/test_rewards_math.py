"""The `math` reward: last \\boxed{} after </think>, compared with math-verify under its own time limit."""

import signal
import threading
import time

import pytest

import rl360.rewards.math as math_reward
from rl360.rewards import compute_score, get_reward_fn
from rl360.rewards.math import MathTimeout, last_boxed, time_limit

P = pytest.param
MATH_CASES = [
    P("The answer is \\boxed{9}.", "9", 1.0, id="integer"),
    P("\\boxed{8}", "9", 0.0, id="wrong-integer"),
    P("\\boxed{1234}", "1234", 1.0, id="larger-integer"),
    P("\\boxed{1,000}", "1000", 1.0, id="thousands-separator"),
    P("\\boxed{-7}", "-7", 1.0, id="negative"),
    P("\\boxed{7}", "-7", 0.0, id="sign-matters"),
    P("\\boxed{\\frac{1}{2}}", "0.5", 1.0, id="fraction-vs-decimal"),
    P("\\boxed{0.5}", "\\frac{1}{2}", 1.0, id="decimal-vs-fraction"),
    P("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0, id="nested-braces"),
    P("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0, id="dfrac-vs-slash"),
    P("\\boxed{\\tfrac{3}{4}}", "\\frac{3}{4}", 1.0, id="tfrac"),
    P("\\boxed{-\\frac{2}{3}}", "-2/3", 1.0, id="negative-fraction"),
    P("\\boxed{\\frac{1}{3}}", "0.5", 0.0, id="wrong-fraction"),
    P("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0, id="sqrt"),
    P("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0, id="sqrt-simplified"),
    P("\\boxed{2\\pi}", "2\\pi", 1.0, id="pi"),
    P("\\boxed{x+1}", "1+x", 1.0, id="expression-reordered"),
    P("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0, id="escaped-braces-set"),
    P("\\boxed{50\\%}", "50\\%", 1.0, id="percent"),
    P("\\boxed{9}", "\\boxed{9}", 1.0, id="truth-already-boxed"),
    P("\\boxed {9}", "9", 1.0, id="space-before-brace"),
    P("so $\\boxed 9$", "9", 1.0, id="boxed-token-without-braces"),
    P("\\fbox{12}", "12", 1.0, id="fbox"),
    P("first \\boxed{3} then \\boxed{4}", "4", 1.0, id="last-box-wins"),
    P("first \\boxed{4} then \\boxed{3}", "4", 0.0, id="earlier-box-ignored"),
    P("<think>maybe \\boxed{5}</think> so \\boxed{6}", "6", 1.0, id="after-think"),
    P("<think>maybe \\boxed{6}</think> so \\boxed{5}", "6", 0.0, id="box-inside-think-ignored"),
    P("<think>\\boxed{6}</think> no box after", "6", 0.0, id="only-box-inside-think"),
    P("<think>a</think><think>\\boxed{1}</think>\\boxed{2}", "2", 1.0, id="last-think-end"),
    P("The answer is 9", "9", 0.0, id="no-box"),
    P("", "9", 0.0, id="empty-response"),
    P("\\boxed{x+1", "x+1", 0.0, id="unclosed-box"),
    P("\\boxed{}", "0", 0.0, id="empty-box"),
    P("\\boxed{banana}", "7", 0.0, id="not-math"),
]


@pytest.mark.parametrize("response,truth,expected", MATH_CASES)
def test_math_reward(response, truth, expected):
    result = compute_score("math__anything", response, truth)
    assert result["score"] == expected
    assert set(result) == {"score", "pred"}


def test_math_is_registered_for_the_math_prefix():
    assert get_reward_fn("math") is math_reward.math_score
    assert get_reward_fn("math__deepscaler_preview") is math_reward.math_score


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
