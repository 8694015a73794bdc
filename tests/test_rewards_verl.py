"""The scorers behind verl's data_source names: GSM8K, stated math answers, Search-R1 exact match, Geometry3K's
format term, and call-based code tests in the sandbox."""

import json

import numpy as np
import pytest

from rl360.rewards import compute_score
from rl360.rewards.codegen import call_arguments, call_expected, call_results_match
from rl360.rewards.geometry import think_then_boxed
from rl360.rewards.gsm8k import final_number, truth_number
from rl360.rewards.math import stated_answer
from rl360.rewards.qa import accepted_answers, normalize_answer

# ----- openai/gsm8k -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("response, number", [
    ("48/2 = 24, 48 + 24 = 72\n#### 72", 72),
    ("#### 1,234", 1234),
    ("#### $5.50", 5.5),
    ("#### -3", -3),
    ("The answer is \\boxed{\\$1,200.}", 1200),
    ("\\boxed{18} first, then I checked.\n#### 17", 17),  # the later of the two forms
    ("#### 17 ... actually \\boxed{18}", 18),
    ("<think>#### 5</think> no final answer", None),
    ("\\boxed{x + 1}", None),
])
def test_gsm8k_final_number(response, number):
    found = final_number(response)
    assert (found is None) if number is None else (found == pytest.approx(number))


def test_gsm8k_scores_numbers_and_reads_full_solutions_as_truth():
    assert compute_score("openai/gsm8k", "#### 72.0", "72")["score"] == 1.0  # verl's exact text match says 0
    assert compute_score("openai/gsm8k", "#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72")["score"] == 1.0
    assert compute_score("openai/gsm8k", "72", "72")["score"] == 0.0  # neither form: no answer
    assert truth_number(" 1,000 ") == 1000
    with pytest.raises(ValueError, match="openai/gsm8k: ground truth must be a number"):
        compute_score("openai/gsm8k", "#### 1", "seventy")


# ----- stated math answers (math_dapo, aime*, numina_*, prime_math) ------------------------------------------


@pytest.mark.parametrize("response, answer", [
    ("Work.\nAnswer: 34", "34"),
    ("Final Answer: The final answer is $\\frac{1}{2}$. I hope it is correct.", "\\frac{1}{2}"),
    ("**Answer:** 12", "12"),
    ("Thus the answer is 7.", "7"),
    ("so \\boxed{3}. Later:\nAnswer: 4", "4"),
    ("Answer: 4\nbut on reflection \\boxed{5}", "5"),
    ("Answer: \\boxed{6}", "6"),
    ("<think>Answer: 1</think>nothing stated", None),
    ("no answer here", None),
])
def test_stated_answer(response, answer):
    assert stated_answer(response) == answer


def test_stated_scores_are_zero_or_one_and_a_bad_truth_is_an_error():
    assert compute_score("math_dapo", "Answer: 34", "34") == {"score": 1.0, "pred": "34"}
    assert compute_score("math_dapo", "Answer: 35", "34") == {"score": 0.0, "pred": "35"}  # verl: -1
    assert compute_score("aime24", "nothing", "34") == {"score": 0.0, "pred": None}
    with pytest.raises(ValueError, match="math: ground truth must be a string"):
        compute_score("math_dapo", "Answer: 3", ["3"])


# ----- searchR1_* ------------------------------------------------------------------------------------------------


def test_search_r1_normalises_as_squad():
    assert normalize_answer("  The  Eiffel-Tower!! ") == "eiffeltower"
    assert normalize_answer("A Tale of Two Cities") == "tale of two cities"


@pytest.mark.parametrize("truth", [
    {"target": ["Paris", "City of Light"]},
    {"target": np.array(["Paris", "City of Light"], dtype=object)},
    {"target": "Paris"},
    json.dumps({"target": ["Paris"]}),
    str({"target": ["Paris", "City of Light"]}),  # a struct that was turned into text
])
def test_search_r1_accepts_every_stored_truth_form(truth):
    assert compute_score("searchR1_nq", "<search>capital of France</search><answer>paris.</answer>", truth)[
        "score"] == 1.0
    assert compute_score("searchR1_nq", "<answer>Paris</answer> then <answer>Lyon</answer>", truth)["score"] == 0.0


def test_search_r1_needs_a_closed_answer_tag_and_a_target():
    truth = {"target": ["Paris"]}
    assert compute_score("searchR1_hotpotqa", "Paris", truth) == {"score": 0.0, "pred": None}
    assert compute_score("searchR1_hotpotqa", "<answer>Paris", truth)["score"] == 0.0
    assert compute_score("searchR1_hotpotqa", "<answer>Paris, France</answer>", truth)["score"] == 0.0  # exact
    with pytest.raises(ValueError, match="searchR1: ground truth must be"):
        accepted_answers({"answers": ["Paris"]})
    with pytest.raises(ValueError, match="non-empty list of strings"):
        accepted_answers({"target": []})


# ----- hiyouga/geometry3k ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("response, fmt", [
    ("<think>r</think> so \\boxed{3}", 1.0),
    ("\n <think>r</think>\\boxed{3}", 1.0),
    ("so \\boxed{3}", 0.0),
    ("<think>r \\boxed{3}</think> done", 0.0),
    ("<think>r</think> \\boxed{3", 0.0),
    ("I think <think>r</think>\\boxed{3}", 0.0),
])
def test_geometry3k_format(response, fmt):
    assert think_then_boxed(response) == fmt


# ----- call-based code tests ---------------------------------------------------------------------------------


def test_call_case_parsing():
    assert call_arguments("1\n[2, 3]\n\"s\"", 0) == [1, [2, 3], "s"]
    assert call_arguments([[1, 2], 3], 0) == [[1, 2], 3]
    with pytest.raises(ValueError, match=r"inputs\[4\]: a call-based input string must hold one JSON value"):
        call_arguments("not json", 4)
    assert call_expected("[1, 2]") == [1, 2] and call_expected("plain text") == "plain text"
    assert call_results_match([1, 2], [1, 2]) and call_results_match([1, 2], [[1, 2]])
    assert call_results_match(0.1 + 0.2, 0.3) and not call_results_match([1], [2])
    assert not call_results_match(True, 1)


CALL_TRUTH = {"fn_name": "solve", "inputs": [[2, 3], [0, 0]], "outputs": [[6], [0]]}


@pytest.mark.parametrize("code, score, failure", [
    ("def solve(a, b):\n    return a * b", 1.0, None),
    ("import sys\ndef solve(a, b):\n    print('debug', a)\n    return a * b\nif __name__ == '__main__':\n"
     "    solve(int(input()), 1)", 1.0, None),  # prints and a main block do not disturb the call
    ("def solve(a, b):\n    return (a * b,)", 1.0, None),  # a tuple is a list in JSON
    ("def solve(a, b):\n    return a + b", 0.0, "case 0: wrong answer"),
    ("def other(a, b):\n    return a * b", 0.0, "named solve"),
    ("def solve(a, b):\n    raise RuntimeError('boom')", 0.0, "RuntimeError: boom"),
    ("def solve(a, b):\n    return {a, b}", 0.0, "cannot be written as JSON"),
])
def test_call_based_tests_run_in_the_sandbox(code, score, failure):
    result = compute_score("apps", f"```python\n{code}\n```", json.dumps(CALL_TRUTH))
    assert result["score"] == score
    assert (failure is None and "failure" not in result) or failure in result["failure"]


def test_a_call_that_never_returns_times_out(monkeypatch):
    monkeypatch.setattr("rl360.rewards.codegen.CASE_TIMEOUT_S", 2.0)
    code = "```python\ndef solve(a, b):\n    while True:\n        pass\n```"
    assert compute_score("apps", code, CALL_TRUTH)["failure"] == "case 0: timeout"


def test_call_based_bad_truths_are_errors():
    with pytest.raises(ValueError, match="'fn_name' must be a Python identifier"):
        compute_score("taco", "```python\nx = 1\n```", {"fn_name": "a b", "inputs": [[1]], "outputs": [1]})
    with pytest.raises(ValueError, match="has 2 inputs but 1 outputs"):
        compute_score("taco", "```python\nx = 1\n```", {"fn_name": "f", "inputs": [[1], [2]], "outputs": [1]})
    with pytest.raises(ValueError, match="codegen ground truth is not JSON"):
        compute_score("codecontests", "```python\nx = 1\n```", "{inputs")


def test_call_based_truth_read_by_pandas_works():
    truth = {"fn_name": "add", "inputs": np.array([np.array([1, 2]), np.array([5, 5])], dtype=object),
             "outputs": np.array([np.int64(3), np.int64(10)])}
    assert compute_score("taco", "```python\ndef add(a, b):\n    return a + b\n```", truth)["score"] == 1.0
