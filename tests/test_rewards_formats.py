"""Answers written the way Reasoning360's datasets' models write them (issue 13): multiple-choice letters
after "Answer:" and its variants, ordering lists in prose, FinQA percentages stored as fractions, and CRUXEval
rows whose ground truth is `{"functional": code}`, answered by an assertion."""

import json

import pytest

from rl360.rewards import compute_score, get_reward_fn, table
from rl360.rewards.logic import items_in_prose
from rl360.rewards.simulation import MAX_ASSERTION_BLOCK_CHARS, last_assertion, python_blocks
from rl360.rewards.stem import SEVERAL, choice_reading, chosen_letter


def _score(source, response, truth, extra=None):
    result = compute_score(source, response, truth, extra)
    return result["score"] if isinstance(result, dict) else result


# ----- multiple choice ------------------------------------------------------------------------------------

GPQA_REASONING = ("The energy difference must exceed the linewidth, ΔE > ħ/τ ≈ 3.3e-7 eV for τ = 1e-9 s, so "
                  "only 1e-4 eV resolves both states.\n\n")


@pytest.mark.parametrize("ending, letter", [
    # OpenAI simple-evals' "Answer: $LETTER" (Reasoning360's *no_box GPQA prompts)
    ("Answer: C", "C"), ("Answer: $C$", "C"), ("Answer: \\(C\\)", "C"), ("Answer: \\[C\\]", "C"),
    ("**Answer:** C", "C"), ("**Answer: C**", "C"), ("Answer: **C**", "C"), ("**Answer: (C)**", "C"),
    ("Answer: $\\text{C}$", "C"), ("Answer: $\\boxed{C}$", "C"), ("ANSWER: C", "C"), ("Answer: [C]", "C"),
    ("**Final Answer:**\n\nC", "C"), ("Answer: C) 10^-4 eV", "C"), ("Answer: C.", "C"),
    # SuperGPQA / General-Reasoner style
    ("Final Answer: The correct option is B", "B"), ("The answer is: B\n", "B"), ("Final Answer: B", "B"),
    ("The final answer is (B)", "B"), ("The final answer is $\\boxed{B}$.", "B"), ("\\boxed{\\text{Option B}}", "B"),
    # prose
    ("Therefore, the correct answer is B.", "B"), ("The correct option is D, since the others fail.", "D"),
    ("The answer is: Option C", "C"), ("Answer: Option C is correct.", "C"), ("The best choice is (A).", "A"),
])
def test_gpqa_and_supergpqa_answer_lines(ending, letter):
    assert chosen_letter(GPQA_REASONING + ending) == letter
    assert _score("stem__gpqa_diamond_no_box", f"<think>hmm</think>{GPQA_REASONING}{ending}", letter) == 1.0
    assert _score("stem__supergpqa", GPQA_REASONING + ending, "A" if letter != "A" else "B") == 0.0


@pytest.mark.parametrize("response", [
    "Answer: A or B", "Answer: A, C", "**Answer:** (A) and (C)", "Answer: B\n\nOn second thought, Answer: A/B",
    "\\boxed{A or B}", "Final Answer: The correct option is either B or C",  # more than one letter
    "the answer is a photon", "Answer: c", "The answer is I think B", "The answer is B because of parity",
    "Answer: $LETTER$",  # the prompt's template echoed
    "The first option is A) 10 eV, too small; the second option is B.",  # weighing options commits to none
    "Answer: A\n\nThe answer is: \\boxed{A, B}",  # the last commitment names two
])
def test_one_capital_letter_only(response):
    assert chosen_letter(response) is None
    assert _score("stem__gpqa", response, "B") == 0.0 and _score("stem__gpqa", response, "A") == 0.0


def test_the_last_commitment_decides():
    assert chosen_letter("Answer: A\n\nWait, that ignores the spin. The correct answer is B.") == "B"
    assert chosen_letter("\\boxed{C} was my first guess.\n\nAnswer: D") == "D"
    assert chosen_letter("The energy is \\boxed{42 \\text{ eV}}, which is option (B).\n\nAnswer: B") == "B"
    assert chosen_letter("Answer: B\n\nso the energy is \\boxed{42}") == "B"  # a box naming no choice is passed over
    assert chosen_letter("Answer: C\n\n\\boxed{A}") == "A"
    assert chosen_letter("<think>Answer: A</think>Answer: D") == "D"


def test_choice_reading_of_boxes_and_statements():
    assert choice_reading("(B) photon", in_box=True) == "B"
    assert choice_reading("B because", in_box=True) is None
    assert choice_reading("(B) photon or (C)", in_box=True) == SEVERAL
    assert choice_reading(" is B, since (C) is excluded", in_box=False) == "B"  # a statement goes on
    assert choice_reading(": A and C", in_box=False) == SEVERAL


# ----- ordering puzzles -----------------------------------------------------------------------------------

BIRDS = json.dumps(["blue jay", "owl", "robin", "quail"])


@pytest.mark.parametrize("answer", [
    "The order is Blue Jay, Owl, Robin, then Quail.",
    "From left to right: blue jay, owl, robin, and finally quail.",
    "1. Blue jay\n2. Owl\n3. Robin\n4. Quail",
    "Final order:\n1) blue jay\n2) owl\n3) robin\n4) quail",
    "- blue jay\n- owl\n- robin\n- quail",
    "blue jay\nowl\nrobin\nquail",
    "blue jay -> owl -> robin -> quail", "Blue Jay → Owl → Robin → Quail", "blue jay > owl > robin > quail",
    "**Blue jay**, **owl**, **robin**, **quail**",
    "The final order is ['blue jay', 'owl', 'robin', 'quail'].",  # Reasoning360 reads a list inside prose
    "['blue jay', 'owl', 'robin', 'quail']", '{"order": ["blue jay", "owl", "robin", "quail"]}',
    "Position 1: blue jay, Position 2: owl, Position 3: robin, Position 4: quail",
])
def test_ordering_lists_in_prose(answer):
    result = compute_score("logic__ordering_puzzle_dataset", f"<think>...</think><answer>{answer}</answer>", BIRDS)
    assert result == {"score": 1.0, "position_accuracy": 1.0}, answer


@pytest.mark.parametrize("answer", [
    "blue jay, owl, robin, sparrow, quail",  # an item the truth does not have
    "sparrow, blue jay, owl, robin, quail", "The order is sparrow blue jay, owl, robin, quail",
    "blue jay, owl, robin",  # one missing
    "blue jay, owl, robin, quail, owl",  # one repeated
    "blue jay, robin, owl, quail",  # the wrong order
    "blue jay owl robin quail",  # nothing separates them
    "owl is after blue jay, robin, quail",
    "2. blue jay\n1. owl\n3. robin\n4. quail", "1. blue jay\n2. owl\n3. robin\n5. quail",  # labels out of order
    "The order is not blue jay, owl, robin, quail", "In reverse: quail, robin, owl, blue jay",
    "blue jay < owl < robin < quail", "blue jay, owl, robin, quail (reversed)",
    "blue jay, owl, robin, quail. Sparrow",
])
def test_ordering_prose_never_reads_a_wrong_list(answer):
    assert _score("logic__ordering_puzzle", f"<answer>{answer}</answer>", BIRDS) == 0.0, answer


def test_items_in_prose_prefers_the_longest_name():
    assert items_in_prose("Jay, blue jay, owl", ["jay", "blue jay", "owl"]) == ["jay", "blue jay", "owl"]
    assert items_in_prose("blue jay, jay", ["jay", "blue jay", "owl"]) is None
    assert items_in_prose("Bluejay, owl", ["blue jay", "owl"]) is None


def test_ordering_prose_keeps_position_accuracy_and_the_answer_tag():
    half = compute_score("logic__ordering_puzzle", "<answer>The order is blue jay, owl, quail, robin.</answer>", BIRDS)
    assert half == {"score": 0.0, "position_accuracy": 0.5}
    assert _score("logic__ordering_puzzle", "The order is blue jay, owl, robin, quail.", BIRDS) == 0.0  # no tag


# ----- FinQA --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("answer, truth, expected", [
    ("14.1", 0.141, 1.0), ("14.1\\%", 0.141, 1.0), ("14.1%", 0.141, 1.0), ("0.141", 0.141, 1.0),
    ("14.1", "0.141", 1.0), ("14.1", 14.1 / 100, 1.0), ("-23.5", -0.235, 1.0), ("-23.5%", "-0.235", 1.0),
    ("14.1", "14.1%", 1.0), ("0.141", "14.1%", 1.0),  # our own preprocessing keeps "14.1%"
    ("14.2", 0.141, 0.0), ("0.141", 14.1, 0.0), ("1410", 14.1, 0.0), ("1410", "14.1", 0.0),
    ("150", 1.5, 0.0), ("150%", 1.5, 1.0),  # |truth| >= 1: an amount, 100x is wrong unless written as a percentage
    ("0", 0.0, 1.0), ("14.1|2", "0.141|2", 1.0), ("2|14.1", "0.141|2", 1.0),
])
def test_finqa_percentages_stored_as_fractions(answer, truth, expected):
    response = f"The ratio is 1,234 / 8,752.\n\n\\boxed{{{answer}}}"
    assert _score("table__finqa", response, truth) == expected


@pytest.mark.parametrize("source", ["table__hitab", "table__multihiertt", "table__multihier"])
def test_other_tables_never_accept_100x(source):
    assert get_reward_fn(source) is table.table_score
    assert _score(source, "\\boxed{14.1}", 0.141) == 0.0
    assert _score(source, "\\boxed{14.1\\%}", 0.141) == 1.0  # a written percentage still reads as its fraction


def test_finqa_routes_to_its_own_rule():
    assert get_reward_fn("table__finqa") is table.finqa_score
    assert table.answers_match("14.1", "0.141", fraction_truths=True)
    assert not table.answers_match("14.1", "0.141")


# ----- CRUXEval as Reasoning360 writes it ----------------------------------------------------------------

CODE = "def f(s, n):\n    return s * n"
FUNCTIONAL = json.dumps({"functional": CODE})


def _crux_extra(task):
    assertion = "assert f('ab', 2) == ??" if task == "o" else "assert f(??) == 'abab'"
    prompt = f"Complete the assertion.\n\n```python\n{CODE}\n{assertion}\n```\n"
    return {"split": "test", "index": 0, "reference": "'abab'", "original_prompt": prompt,
            "dataset": f"cruxeval-{task}", "task_id": "sample_0"}


def _block(body, thinking="s * n repeats 'ab' twice"):
    return f"<think>{thinking}</think>\n```python\n{body}\n```"


def test_cruxeval_output_assertion_runs_in_the_sandbox():
    response = _block("assert f('ab', 2) == 'abab'")
    result = compute_score("simulation__cruxeval-o", response, FUNCTIONAL, _crux_extra("o"))
    assert result == {"score": 1.0, "pred": "assert f('ab', 2) == 'abab'"}
    restated = _block(f"{CODE}\n\nassert f('ab', 2) == \"abab\"  # two copies")
    assert _score("simulation__cruxeval-o", restated, FUNCTIONAL, _crux_extra("o")) == 1.0
    as_dict = {"functional": CODE}  # a ground truth already read from JSON
    assert _score("simulation__cruxeval-o", _block("assert 'abab' == f('ab', 2)"), as_dict, _crux_extra("o")) == 1.0


def test_cruxeval_input_assertion_may_use_any_input_with_the_output():
    for body, expected in [("assert f('abab', 1) == 'abab'", 1.0), ("assert f(s='ab', n=2) == 'abab'", 1.0),
                           ("assert f('ab', 3) == 'abab'", 0.0)]:
        assert _score("simulation__cruxeval-i", _block(body), FUNCTIONAL, _crux_extra("i")) == expected, body
    # the block's own code is never run: the truth's f gives 'zz' here, not 'abab'
    cheat = _block("def f(s, n):\n    return 'abab'\n\nassert f('z', 2) == 'abab'")
    assert _score("simulation__cruxeval-i", cheat, FUNCTIONAL, _crux_extra("i")) == 0.0
    generic = _crux_extra("i")  # simulation__cruxeval reads the task from extra_info["dataset"]
    assert _score("simulation__cruxeval", _block("assert f('abab', 1) == 'abab'"), FUNCTIONAL, generic) == 1.0


def test_cruxeval_a_bare_assertion_without_a_fence_scores_as_reasoning360_scores_it():
    # Reasoning360 runs the reply after </think> (all of it without one) after the function's code, fenced
    # or not: a bare assert line passes when right, fails when wrong, and prose around it does not run
    for response in ("assert f('ab', 2) == 'abab'", "<think>s * n</think>\nassert f('ab', 2) == 'abab'\n"):
        result = compute_score("simulation__cruxeval-o", response, FUNCTIONAL, _crux_extra("o"))
        assert result == {"score": 1.0, "pred": "assert f('ab', 2) == 'abab'"}, response
    assert _score("simulation__cruxeval-i", "<think>x</think>assert f('abab', 1) == 'abab'", FUNCTIONAL,
                  _crux_extra("i")) == 1.0
    for response in ("assert f('ab', 2) == 'ab'", "<think>s * n</think>\nassert f('ab', 3) == 'abab'",
                     "The completed assertion:\nassert f('ab', 2) == 'abab'", "assert True"):
        assert _score("simulation__cruxeval-o", response, FUNCTIONAL, _crux_extra("o")) == 0.0, response


@pytest.mark.parametrize("task, response, failure", [
    ("o", "The answer is 'abab'.", "no fenced block"),  # no assert block
    ("o", "<think>```python\nassert f('ab', 2) == 'abab'\n```</think>done", "no fenced block"),  # only in thinking
    ("o", _block("assert True"), "no fenced block"),
    ("o", _block("assert f('ab', 2) == f('ab', 2)"), "no fenced block"),
    ("o", _block("assert 'abab' == 'abab'"), "no fenced block"),
    ("o", _block("x = ('ab', 2)\nassert f(*x) == 'abab'"), "no fenced block"),
    ("o", _block("assert f('ab', 2) == 'ab' * 2"), "no fenced block"),  # not a literal
    ("o", _block("assert f('ab', 2) == 'abab' or True"), "no fenced block"),
    ("o", _block("assert f('ab', 2) != 'x'"), "no fenced block"),
    ("o", _block("assert f('ab', 2) == 'abab', 'msg'"), "no fenced block"),
    ("o", _block("assert f('ab', 2) == 'abab'\nassert f('a', 1) == 'a'"), "no fenced block"),  # two assertions
    ("o", _block("assert g('ab', 2) == 'abab'"), "no fenced block"),  # not a function of the code
    ("o", _block("assert f(__import__('os').getpid(), 2) == 'abab'"), "no fenced block"),
    ("o", _block("assert f('abab', 1) == 'abab'"), "another input"),  # true, but not the task's input
    ("o", _block("assert f('ab', 2) == 'ab'"), "output is not the task's"),
    ("i", _block("assert f('', 5) == ''"), "output is not the task's"),  # true, but not the task's output
])
def test_cruxeval_assertions_that_must_not_score(task, response, failure):
    result = compute_score(f"simulation__cruxeval-{task}", response, FUNCTIONAL, _crux_extra(task))
    assert result["score"] == 0.0 and failure in result["failure"], result


def test_cruxeval_last_assertion_is_parsed_not_run():
    assertion = last_assertion("```python\nprint(1)\n```\n```py\nassert f([1, 2], k={'a': 1}) == (3,)\n```", {"f"})
    assert assertion == ("f", ["[1, 2]"], {"k": "{'a': 1}"}, "(3,)")
    broken = "```python\ndef f(x)\n    return x\nassert f(1) == 1\n```"  # a restated function with a typo
    assert last_assertion(broken, {"f"}).expected == "1"


def test_cruxeval_reads_python_fences_only_and_bounds_their_size():
    text = "```js\nassert(f(1) == 1)\n```\n```Python\nassert f(1) == 1\n```\n```\nx = 2\n```\n```python\nunclosed"
    assert python_blocks(text) == ["assert f(1) == 1\n", "x = 2\n"]
    padded = _block("x = 0\n" * (MAX_ASSERTION_BLOCK_CHARS // 6) + "assert f('ab', 2) == 'abab'")
    result = compute_score("simulation__cruxeval-o", padded, FUNCTIONAL, _crux_extra("o"))
    assert result["score"] == 0.0 and "no fenced block" in result["failure"]


def test_cruxeval_functional_rows_need_their_pins_and_code():
    response = _block("assert f('ab', 2) == 'abab'")
    with pytest.raises(ValueError, match=r"extra_info\['reference'\]"):
        _score("simulation__cruxeval-i", response, FUNCTIONAL, {"dataset": "cruxeval-i"})
    with pytest.raises(ValueError, match=r"original_prompt"):
        _score("simulation__cruxeval-o", response, FUNCTIONAL, None)
    reference_only = {"reference": "'abab'"}  # no prompt: the output pins the assertion
    assert _score("simulation__cruxeval-o", response, FUNCTIONAL, reference_only) == 1.0
    assert _score("simulation__cruxeval-o", _block("assert f('', 1) == ''"), FUNCTIONAL, reference_only) == 0.0
    with pytest.raises(ValueError, match="not a Python literal"):
        _score("simulation__cruxeval-o", response, FUNCTIONAL, {"reference": "abab"})
    with pytest.raises(ValueError, match="defines no function"):
        _score("simulation__cruxeval-o", response, json.dumps({"functional": "x = 1"}), _crux_extra("o"))
    with pytest.raises(ValueError, match="not Python"):
        _score("simulation__cruxeval-o", response, json.dumps({"functional": "def f(:"}), _crux_extra("o"))
    with pytest.raises(ValueError, match="must be the function's code"):
        _score("simulation__cruxeval-o", response, json.dumps({"functional": ""}), _crux_extra("o"))
