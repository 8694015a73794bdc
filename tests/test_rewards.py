"""The reward registry, the math reward and the timeout-wrapped pool."""

import time

import pytest

import tests.reward_fixtures  # noqa: F401  (registers the test_* prefixes)
from rl360.rewards import RewardItem, RewardPool, check_data_sources, compute_score, register_reward_path
from rl360.rewards.math import last_boxed

MATH_CASES = [
    ("The answer is \\boxed{9}", "9", 1.0),
    ("\\boxed{9}", "9", 1.0),
    ("\\boxed{8}", "9", 0.0),
    ("9", "9", 0.0),  # no \boxed
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("\\boxed{-7}", "-7", 1.0),
    ("\\boxed{7}", "-7", 0.0),
    ("first \\boxed{3} then \\boxed{4}", "4", 1.0),  # the last box counts
    ("first \\boxed{4} then \\boxed{3}", "4", 0.0),
    ("<think>\\boxed{5}</think> so \\boxed{6}", "6", 1.0),
    ("<think>\\boxed{6}</think> no box after", "6", 0.0),
    ("\\fbox{12}", "12", 1.0),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
    ("\\boxed{2\\pi}", "2\\pi", 1.0),
    ("\\boxed{x+1", "x+1", 0.0),  # unbalanced
    ("\\boxed{}", "0", 0.0),
]


@pytest.mark.parametrize("response,truth,expected", MATH_CASES)
def test_math_reward(response, truth, expected):
    assert compute_score("math__anything", response, truth)["score"] == expected


def test_last_boxed_balances_braces():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed("nothing") is None


def test_unknown_data_sources_are_listed_at_once():
    check_data_sources(["math__x", "math"])
    with pytest.raises(KeyError, match=r"\['codegen__y', 'zzz'\]"):
        check_data_sources(["math__x", "zzz", "codegen__y"])


def test_register_by_path_must_import():
    register_reward_path("test_path", "tests.reward_fixtures:echo")
    assert compute_score("test_path__a", "x", "x")["score"] == 1.0
    with pytest.raises(ModuleNotFoundError):
        register_reward_path("test_bad", "no_such_module:fn")


def test_pool_scores_in_order_with_extras():
    items = [RewardItem("math__t", f"\\boxed{{{i % 3}}}", "1") for i in range(20)]
    items.append(RewardItem("test_echo", "a", "a", {"k": 1}))
    with RewardPool(num_workers=2, timeout_s=30) as pool:
        results = pool.score(items)
    assert [r.score for r in results[:20]] == [1.0 if i % 3 == 1 else 0.0 for i in range(20)]
    assert results[20].extras == {"seen": {"k": 1}}
    assert results[5].extras["pred"] == "2"


def test_hanging_reward_costs_one_timeout_each_and_pool_recovers():
    items = [RewardItem("test_hang", "x", "y") for _ in range(6)]
    with RewardPool(num_workers=2, timeout_s=1.0) as pool:
        started = time.monotonic()
        results = pool.score(items)
        elapsed = time.monotonic() - started
        assert all(r.score == 0.0 and r.timed_out for r in results)
        assert pool.last_metrics()["reward/timeouts"] == 6
        assert pool.last_metrics()["reward/timeouts/test_hang"] == 6
        assert elapsed < 20  # 3 rounds of 1 s timeouts, not a hang
        after = pool.score([RewardItem("math__t", "\\boxed{2}", "2"), RewardItem("math__t", "\\boxed{1}", "2")])
        assert [r.score for r in after] == [1.0, 0.0]
        assert pool.last_metrics()["reward/timeouts"] == 0
        assert pool.totals["reward/timeouts"] == 6


def test_raising_and_dying_rewards_score_zero_with_errors():
    items = [RewardItem("test_raise", "oops", "y"), RewardItem("test_exit", "x", "y"),
             RewardItem("math__t", "\\boxed{3}", "3")]
    with RewardPool(num_workers=1, timeout_s=10) as pool:
        results = pool.score(items)
        assert results[0].score == 0.0 and "ValueError: bad response 'oops'" in results[0].error
        assert results[1].score == 0.0 and "died" in results[1].error
        assert results[2].score == 1.0 and results[2].error is None
        assert pool.last_metrics()["reward/errors"] == 2


def test_in_process_mode_has_no_workers():
    pool = RewardPool(num_workers=0)
    assert [r.score for r in pool.score([RewardItem("math", "\\boxed{1}", "1")])] == [1.0]
    pool.close()
