"""Logic, simulation, table, stem and format rewards: correct, wrong, partial and malformed answers, bad ground
truths, every data_source name routed to its function, and a round trip through each preprocessing script's
rows."""

import json

import pytest

from rl360.rewards import compute_score, get_reward_fn, logic, simulation, stem, table
from rl360.rewards.extract import as_number, last_answer_tag, last_json_object
from rl360.rewards.format import LEWIS_SPEAKER_TAGS, length_score, one_sentence, tag_content, tags_format, think_format
from rl360.rewards.simulation import call_arguments
from rl360.rewards.stem import chosen_letter
from tests.test_preprocess import _rows, _run_script

ZEBRA = json.dumps({"header": ["House", "Name", "Pet"], "rows": [["1", "Alice", "cat"], ["2", "Bob", "dog"]]})
CRUX = json.dumps({"code": "def f(s, n):\n    return s * n", "input": "'ab', 2", "output": "'abab'"})


def _score(source, response, truth, extra=None):
    result = compute_score(source, response, truth, extra)
    return result["score"] if isinstance(result, dict) else result


# ----- routing -----------------------------------------------------------------------------------------

ROUTES = {
    # what data_preprocess/ writes
    "logic__zebra_puzzle": logic.zebra_score, "logic__ordering_puzzle": logic.ordering_score,
    "logic__graph_search": logic.graph_score, "simulation__codeio": simulation.codeio_score,
    "simulation__cruxeval_o": simulation.cruxeval_output_score,
    "simulation__cruxeval_i": simulation.cruxeval_input_score,
    "table__hitab": table.table_score, "table__multihiertt": table.table_score, "table__finqa": table.finqa_score,
    "stem__webinstruct": stem.stem_score, "stem__gpqa": stem.stem_score, "stem__gpqa_diamond": stem.stem_score,
    # Reasoning360's names
    "logic__zebra_puzzle_dataset": logic.zebra_score, "logic__ordering_puzzle_dataset": logic.ordering_score,
    "logic__graph_logical_dataset": logic.graph_score, "simulation__codeio_fixed": simulation.codeio_score,
    "simulation__cruxeval-o": simulation.cruxeval_output_score,
    "simulation__cruxeval-i": simulation.cruxeval_input_score, "simulation__cruxeval": simulation.cruxeval_score,
    "simulation__arcagi1": simulation.arcagi_score, "simulation__arcagi2": simulation.arcagi_score,
    "simulation__barc": simulation.arcagi_score, "logic__arcagi1": simulation.arcagi_score,
    "logic__arcagi2": simulation.arcagi_score, "logic__barc": simulation.arcagi_score,
    "table__multihier": table.table_score, "stem__supergpqa": stem.stem_score,
    "ordering_puzzle_dataset": logic.ordering_score,  # Reasoning360's puzzle generator, before its logic__ prefix
}


@pytest.mark.parametrize("source", sorted(ROUTES))
def test_every_data_source_resolves_to_its_function(source):
    assert get_reward_fn(source) is ROUTES[source]


def test_unregistered_logic_and_simulation_names_stay_unknown():
    for source in ("logic__sudoku", "simulation__other"):
        with pytest.raises(KeyError, match="no reward function"):
            get_reward_fn(source)


# ----- logic ---------------------------------------------------------------------------------------------

def _grid(rows, header=("House", "Name", "Pet")):
    return "<think>hmm</think><answer>" + json.dumps({"header": list(header), "rows": rows}) + "</answer>"


def test_zebra_gives_credit_per_cell():
    right = _grid([["1", "alice", "Cat"], ["2", " Bob ", "dog"]])
    assert compute_score("logic__zebra_puzzle", right, ZEBRA) == {"score": 1.0, "acc": 1.0, "cells_right": 6,
                                                                  "cells": 6}
    one_off = '<answer>[["1", "Alice", "dog"], ["2", "Bob", "dog"]]</answer>'  # a bare list of rows
    assert _score("logic__zebra_puzzle", one_off, ZEBRA) == pytest.approx(5 / 6)
    assert compute_score("logic__zebra_puzzle", one_off, ZEBRA)["acc"] == 0.0
    assert _score("logic__zebra_puzzle", '<answer>{"rows": [["1", "Alice", "cat"]]}</answer>', ZEBRA) == 0.5
    extra_row = _grid([["1", "Alice", "cat"], ["2", "Bob", "dog"], ["3", "Carl", "fox"]])
    assert _score("logic__zebra_puzzle", extra_row, ZEBRA) == pytest.approx(6 / 9)  # 1.0 only for the exact grid
    reordered = _grid([["cat", "1", "Alice"], ["dog", "2", "Bob"]], header=("Pet", "House", "Name"))
    assert _score("logic__zebra_puzzle", reordered, ZEBRA) == 1.0  # columns matched by name
    table = "<answer>\n| House | Name | Pet |\n|---|---|---|\n| 1 | Alice | cat |\n| 2 | Bob | fox |\n</answer>"
    assert _score("logic__zebra_puzzle", table, ZEBRA) == pytest.approx(5 / 6)


@pytest.mark.parametrize("response", [
    "", "no tag at all", "<answer>not json</answer>", "<answer>42</answer>", "<answer></answer>",
    '<answer>{"rows": "1 Alice cat"}</answer>', '<think><answer>[["1", "Alice", "cat"]]</answer></think> done',
    '<answer>[["1", "Alice", "cat"], ["2", "Bob", "dog"]]</answer> then <answer>[["1"',
])
def test_zebra_malformed_answers_score_zero(response):
    assert _score("logic__zebra_puzzle", response, ZEBRA) == 0.0


def test_ordering_is_all_or_nothing_with_position_accuracy():
    truth = json.dumps(["red", "green", "blue"])
    for answer in ["['Red', 'green', 'blue']", '["red", "green", "blue"]', "red, green, blue", "red -> green -> blue",
                   "[red, green, blue]", "```json\n[\"red\", \"green\", \"blue\"]\n```"]:
        assert _score("logic__ordering_puzzle", f"<answer>{answer}</answer>", truth) == 1.0, answer
    swapped = compute_score("logic__ordering_puzzle", '<answer>["red", "blue", "green"]</answer>', truth)
    assert swapped == {"score": 0.0, "position_accuracy": pytest.approx(1 / 3)}
    short = compute_score("logic__ordering_puzzle", '<answer>["red", "green"]</answer>', truth)
    assert short == {"score": 0.0, "position_accuracy": pytest.approx(2 / 3)}
    for bad in ["red green blue", "", "<answer></answer>", "<answer>{}</answer>"]:
        assert _score("logic__ordering_puzzle", bad, truth) == 0.0, bad
    assert _score("logic__ordering_puzzle", "<answer>['b', 'a']</answer>", "['b', 'a']") == 1.0  # literal truth


@pytest.mark.parametrize("answer, expected", [
    ("B", 1.0), (" b ", 1.0), ("(B)", 1.0), ("B.", 1.0), ("B)", 1.0), ("C", 0.0), ("(C)", 0.0), ("", 0.0),
    ("BC", 0.0),
])
def test_graph_choice(answer, expected):
    assert _score("logic__graph_search", f"<think>path A->B</think><answer>{answer}</answer>", "B") == expected


def test_graph_needs_the_answer_tag():
    assert _score("logic__graph_search", "The answer is B", "B") == 0.0


# ----- simulation ----------------------------------------------------------------------------------------

def test_codeio_compares_the_last_json_object():
    truth = json.dumps({"output": {"total": 6, "items": [1, 2, 3]}})
    good = 'Tracing it: {"x": 1} then finally ```json\n{"output": {"total": 6.0, "items": [1, 2, 3]}}\n```'
    assert _score("simulation__codeio", good, truth) == 1.0
    assert _score("simulation__codeio", "{'output': {'total': 6, 'items': [1, 2, 3]}}", truth) == 1.0  # Python dict
    assert _score("simulation__codeio", '{"output": {"total": 7, "items": [1, 2, 3]}}', truth) == 0.0
    assert _score("simulation__codeio", '{"output": {"total": 6, "items": [3, 2, 1]}}', truth) == 0.0
    assert _score("simulation__codeio", '{"input": {"total": 6, "items": [1, 2, 3]}}', truth) == 0.0
    assert _score("simulation__codeio", '<think>{"output": {"total": 6, "items": [1, 2, 3]}}</think> no', truth) == 0.0


@pytest.mark.parametrize("given, truth, expected", [
    ("true", "1", 0.0), ("1", "true", 0.0), ('"HELLO"', '"hello"', 0.0), ('" hello "', '"hello"', 1.0),
    ("0.30000000000000004", "0.3", 1.0), ("0.31", "0.3", 0.0), ("null", "null", 1.0), ('"5"', "5", 0.0),
])
def test_codeio_value_comparison(given, truth, expected):
    assert _score("simulation__codeio", f'{{"output": {given}}}', f'{{"output": {truth}}}') == expected


def test_codeio_input_prediction_and_reasoning360_fragments():
    truth = json.dumps({"input": {"numbers": [1, 2, 3, 4]}})
    assert _score("simulation__codeio", 'So {"input": {"numbers": [1, 2, 3, 4]}}', truth) == 1.0
    assert _score("simulation__codeio", 'So {"numbers": [1, 2, 3, 4]}', truth) == 1.0  # the bare arguments
    assert _score("simulation__codeio", 'So {"input": {"numbers": [4, 2]}}', truth) == 0.0  # only the recorded one
    assert _score("simulation__codeio", '{"input": {"n": 5}}', '"input": {"n": 5}') == 1.0
    both = json.dumps({"input": {"n": 5}, "output": 25})
    assert _score("simulation__codeio", '{"output": 25}', both, {"predict": "output"}) == 1.0
    with pytest.raises(ValueError, match="simulation__codeio"):
        _score("simulation__codeio", '{"output": 25}', both)


def test_codeio_malformed_and_pathological_responses():
    truth = json.dumps({"output": 1})
    for response in ["", "no json", "{", "{'output': }", "{" * 3000 + "}" * 3000, '{"a": ' * 5000, "[1, 2]"]:
        assert _score("simulation__codeio", response, truth) == 0.0
    assert last_json_object("x " * 20000 + '{"output": 1}') == {"output": 1}


@pytest.mark.parametrize("answer, expected", [
    ("'abab'", 1.0), ('"abab"', 1.0), ("  'abab'  ", 1.0), ("`'abab'`", 1.0), ("```python\n'abab'\n```", 1.0),
    ("'ab'", 0.0), ("abab", 0.0),
    ("'ab' * 2", 0.0), ("", 0.0),
])
def test_cruxeval_output_prediction(answer, expected):
    assert _score("simulation__cruxeval_o", f"<think>trace</think><answer>{answer}</answer>", CRUX) == expected


def test_cruxeval_output_compares_python_values_else_text():
    truth = json.dumps({"code": "def f(x):\n    return x", "input": "1", "output": "{'a': [1, 2.0], 'b': (3,)}"})
    assert _score("simulation__cruxeval_o", "<answer>{'b': (3,), 'a': [1, 2]}</answer>", truth) == 1.0
    assert _score("simulation__cruxeval_o", "<answer>{'b': [3], 'a': [1, 2]}</answer>", truth) == 0.0
    odd = json.dumps({"code": "def f():\n    return float('inf')", "input": "", "output": "inf"})  # no literal
    assert _score("simulation__cruxeval_o", "<answer> inf </answer>", odd) == 1.0


@pytest.mark.parametrize("answer, expected", [
    ("'ab', 2", 1.0), ("f('ab', 2)", 1.0), ("'ab' ,  2", 1.0),  # the recorded input: no run needed
    ("'abab', 1", 1.0), ("s='ab', n=2", 1.0), ("'ab', n=2", 1.0),  # run in the sandbox: f gives the output
    ("'a', 3", 0.0), ("'ab'", 0.0), ("'ab', 2, 3", 0.0),  # wrong output; TypeErrors in f
])
def test_cruxeval_input_prediction(answer, expected):
    assert _score("simulation__cruxeval_i", f"<answer>{answer}</answer>", CRUX) == expected
    assert _score("simulation__cruxeval", f"<answer>{answer}</answer>", CRUX, {"task": "input"}) == expected


@pytest.mark.parametrize("answer", [
    "'zz', 1) == None or f('ab', 2",  # would make `assert f(...) == out` true if pasted into code
    "1) or True or (1", "__import__('os').system('true')", "*['ab', 2]", "**{'s': 'ab', 'n': 2}",
    "'a' * 2, 2", ")(", "g('ab', 2)",
])
def test_cruxeval_input_answers_must_be_literals(answer):
    result = compute_score("simulation__cruxeval_i", f"<answer>{answer}</answer>", CRUX)
    assert result["score"] == 0.0 and "literals" in result["failure"]


def test_call_arguments_are_parsed_not_run():
    assert call_arguments("'hi', [1, 2], k=(3,)") == (["'hi'", "[1, 2]"], {"k": "(3,)"})
    assert call_arguments("f()") == ([], {})
    assert call_arguments("print('x')") is None and call_arguments("x") is None


def test_cruxeval_task_from_extra_info_and_bad_truths():
    assert _score("simulation__cruxeval", "<answer>'abab'</answer>", CRUX) == 1.0  # output by default
    assert _score("simulation__cruxeval_o", "<answer>'abab'</answer>", CRUX, {"task": "input"}) == 1.0  # name wins
    with pytest.raises(ValueError, match="simulation__cruxeval.*needs code, input and output"):
        _score("simulation__cruxeval_o", "<answer>1</answer>", json.dumps({"code": "x"}))
    with pytest.raises(ValueError, match="not JSON or a Python literal: '{broken'"):
        _score("simulation__cruxeval_o", "<answer>1</answer>", "{broken")
    assert _score("simulation__cruxeval_o", "no answer tag", CRUX) == 0.0


def test_arcagi_grid_must_match_cell_for_cell():
    truth = json.dumps([[0, 1], [1, 0]])
    assert _score("simulation__arcagi", "The grid is [[0, 1], [1, 0]].", truth) == 1.0
    assert _score("simulation__arcagi", "<answer>[[0,1],[1,0]]</answer> and later [[5]]", truth) == 1.0
    assert _score("simulation__arcagi", "<answer>\n0 1\n1 0\n</answer>", truth) == 1.0
    assert _score("simulation__arcagi", "<answer>[[0, 1], [1, 1]]</answer>", truth) == 0.0
    assert _score("simulation__arcagi", "[[0, 1]]", truth) == 0.0
    assert _score("simulation__arcagi", "<think>[[0, 1], [1, 0]]</think> no grid", truth) == 0.0
    assert _score("simulation__arcagi", "[[" * 3000 + "]]" * 3000, truth) == 0.0
    assert _score("simulation__arcagi", "<answer>[[0, 1], [1, 0]]</answer>", "[[0, 1], [1, 0]]") == 1.0
    with pytest.raises(ValueError, match="list of lists of ints"):
        _score("simulation__arcagi", "x", json.dumps({"grid": 1}))


@pytest.mark.parametrize("source", ["simulation__arcagi1", "simulation__arcagi2", "simulation__barc",
                                    "logic__arcagi1", "logic__arcagi2", "logic__barc", "logic__barc_1.6k"])
def test_every_arc_name_scores_grids(source):
    truth = json.dumps([[8, 8, 3], [1, 0, 0]])
    assert _score(source, "<think>[[0]]</think><answer>[[8, 8, 3], [1, 0, 0]]</answer>", truth) == 1.0
    assert _score(source, "<answer>[[8, 8, 3], [1, 0, 1]]</answer>", truth) == 0.0
    assert _score(source, "<answer>[[8, 8, 3]]</answer>", truth) == 0.0


# ----- table ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pred, truth, expected", [
    ("1,234.5", "1234.5", 1.0), ("$3", "3", 1.0), ("\\$3", "3", 1.0), ("-\\$3", "-3", 1.0), ("$ 1,000", "1000", 1.0),
    ("14.1\\%", "14.1%", 1.0), ("0.141", "14.1%", 1.0), ("14.1", "14.1%", 1.0), ("12\\%", "0.12", 1.0),
    ("14.1", "0.141", 0.0), ("1,2", "12", 0.0), ("3.14159", "3.1416", 1.0), ("3.2", "3.1", 0.0), ("\u22125", "-5", 1.0),
    ("1520", "1520.0", 1.0), ("1520.2", "1520", 0.0), ("\\frac{1}{2}", "0.5", 1.0),
    ("Paris", " paris. ", 1.0), ("\\text{Paris}", "Paris", 1.0), ("Lyon", "Paris", 0.0),
    ("b|a", "a|b", 1.0), ("a | b", "a|b", 1.0), ("a", "a|b", 0.0), ("a|b|c", "a|b", 0.0), ("a|a", "a|b", 0.0),
    ("2020|2019", "2019|2020", 1.0), ("1|1.0", "1|1", 1.0),
])
@pytest.mark.parametrize("source", ["table__hitab", "table__finqa"])
def test_table_numeric_tolerance_and_lists(pred, truth, expected, source):
    if source == "table__finqa" and (pred, truth) == ("14.1", "0.141"):
        expected = 1.0  # FinQA only: a fraction truth below 1 is a percentage (test_rewards_formats.py)
    assert _score(source, f"<think>\\boxed{{0}}</think> so \\boxed{{{pred}}}", truth) == expected


def test_table_tolerance_per_row_and_missing_answers():
    assert _score("table__finqa", "\\boxed{3.2}", "3.1", {"rel_tol": 0.05}) == 1.0
    for response in ["the answer is 3", "", "\\boxed{}", "\\boxed{3"]:
        assert _score("table__hitab", response, "3") == 0.0
    with pytest.raises(ValueError, match="empty ground truth"):
        _score("table__hitab", "\\boxed{3}", " | ")


@pytest.mark.parametrize("text, number", [
    ("1,234.5", 1234.5), ("$12", 12.0), ("-$3", -3.0), ("4.5%", 4.5), ("\\$3", 3.0), ("12\\%", 12.0),
    ("\\text{7}", 7.0), ("1e3", 1000.0), (3, 3.0), (True, None), ("1,2", None), ("3 apples", None), ("", None),
])
def test_as_number(text, number):
    assert as_number(text) == number


# ----- stem ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("response, letter", [
    ("\\boxed{B}", "B"), ("\\boxed{(C)}", "C"), ("\\boxed{\\text{B}}", "B"), ("\\boxed{\\textbf{(D)}}", "D"),
    ("\\boxed{D. 42 kg}", "D"), ("\\boxed{(B) photon}", "B"), ("so the answer is (A)", "A"), ("Answer: C", "C"),
    ("**Answer:** B", "B"), ("The correct answer is D.", "D"), ("After all that, I choose (B)", "B"),
    ("<think>\\boxed{A}</think> \\boxed{B}", "B"), ("Answer: A\n\nOn reflection, \\boxed{C}", "C"),
    ("\\boxed{42}", None), ("no idea", None), ("the answer is a photon", None), ("Answer: c", None),
    ("\\boxed{A or B}", None), ("\\boxed{A, C}", None), ("\\boxed{(A) or (B)}", None), ("\\boxed{AB}", None),
    ("\\boxed{A} is wrong, so \\boxed{}", None), ("answer is B because of x", None), ("", None),
])
def test_multiple_choice_letter(response, letter):
    assert chosen_letter(response) == letter


def test_stem_multiple_choice_and_free_form():
    assert compute_score("stem__gpqa", "\\boxed{B}", "B") == {"score": 1.0, "pred": "B"}
    assert _score("stem__gpqa", "\\boxed{C}", "B") == 0.0
    assert _score("stem__gpqa", "The answer is a photon", "A") == 0.0
    assert _score("stem__gpqa", "\\boxed{B}", "(B)") == 1.0
    assert _score("stem__webinstruct", "\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert _score("stem__webinstruct", "\\boxed{9 \\text{ J}}", "9") == 1.0
    assert _score("stem__webinstruct", "\\boxed{2}", "0.5") == 0.0
    assert _score("stem__webinstruct", "", "0.5") == 0.0
    with pytest.raises(ValueError, match="empty ground truth"):
        _score("stem__gpqa", "\\boxed{B}", "  ")


# ----- format and shared extraction ---------------------------------------------------------------------

def test_answer_tag_extraction():
    assert last_answer_tag("<answer> a </answer> <answer>b</answer>") == "b"
    assert last_answer_tag("<think><answer>a</answer></think><answer>b</answer>") == "b"
    assert last_answer_tag("<think><answer>a</answer></think> none after") is None
    assert last_answer_tag("<answer>a</answer> then <answer>unclosed") is None
    assert last_answer_tag("<ANSWER>x</ANSWER>") == "x"


def test_think_format():
    assert think_format("<think>plan</think> The answer is 4.") == 1.0
    assert think_format("\n<think>plan</think>\\boxed{4}") == 1.0
    for bad in ["The answer is 4.", "<think>a</think>", "<think>a</think> x <think>b</think> y",
                "x <think>a</think> y", "<think>a<think>b</think> c", "", "<think>unclosed"]:
        assert think_format(bad) == 0.0, bad
    assert think_format("plan</think> 4", think_in_prompt=True) == 1.0
    assert think_format("<think>plan</think> 4", think_in_prompt=True) == 0.0
    assert think_format("plan</think>", think_in_prompt=True) == 0.0


LEWIS = "<thinking>it is a dog</thinking>\n<coarse>A photo of a dog</coarse>\n<detailed>A golden dog.</detailed>"


def test_lewis_speaker_format():
    assert tags_format(LEWIS, LEWIS_SPEAKER_TAGS) == 1.0
    assert tags_format(LEWIS, LEWIS_SPEAKER_TAGS, strict=True) == 1.0
    assert tag_content(LEWIS, "detailed") == "A golden dog."
    unordered = "<coarse>x</coarse><thinking>y</thinking><detailed>z</detailed>"
    assert tags_format("Sure! " + LEWIS, LEWIS_SPEAKER_TAGS) == 1.0  # present and closed is enough...
    assert tags_format(unordered, LEWIS_SPEAKER_TAGS) == 1.0
    assert tags_format("Sure! " + LEWIS, LEWIS_SPEAKER_TAGS, strict=True) == 0.0  # ...unless strict
    assert tags_format(unordered, LEWIS_SPEAKER_TAGS, strict=True) == 0.0
    for bad in [LEWIS.replace("</coarse>", ""), LEWIS + "<coarse>again</coarse>", LEWIS.replace("<detailed>", ""),
                "<thinking><coarse>x</coarse></thinking><detailed>y</detailed>",
                "</coarse>x<coarse><thinking>y</thinking><detailed>z</detailed>", ""]:
        assert tags_format(bad, LEWIS_SPEAKER_TAGS) == 0.0, bad
    assert tag_content("no tags", "detailed") is None


def test_length_rewards():
    assert one_sentence("A golden dog with a red collar.") == 1.0
    assert one_sentence("A dog weighing 3.5 kg!") == 1.0
    assert one_sentence("A dog. It is golden.") == 0.0
    assert one_sentence("A golden dog") == 0.0
    assert one_sentence("") == 0.0
    assert 0.1 * one_sentence(tag_content(LEWIS, "detailed")) == 0.1  # the Lewis game's length reward
    assert [length_score(n, 100, 10) for n in (100, 110, 115, 120, 200, 85)] == [1.0, 1.0, 0.5, 0.0, 0.0, 0.5]


# ----- round trip through the preprocessing scripts ----------------------------------------------------

def _correct_response(source, truth, extra):
    """A response that answers the row right, in the format its prompt asks for."""
    if source.startswith("simulation__cruxeval"):
        value = json.loads(truth)["input" if extra["task"] == "input" else "output"]
        return f"<think>work</think><answer>{value}</answer>"
    if source.startswith("logic__"):
        return f"<think>work</think><answer>{truth}</answer>"
    if source.startswith("simulation__codeio"):
        return f"<think>work</think> The result is {truth}"
    return f"<think>work</think> so \\boxed{{{truth}}}"


RUNS = [  # (script, extra arguments)
    ("logic.zebra_puzzle", []), ("logic.ordering_puzzle", []), ("logic.graph_search", []),
    ("simulation.codeio", ["--predict", "output"]), ("simulation.codeio", ["--predict", "input"]),
    ("simulation.cruxeval", ["--task", "output"]), ("simulation.cruxeval", ["--task", "input"]),
    ("table.hitab", []), ("table.multihiertt", []), ("table.finqa", []),
    ("stem.webinstruct", []), ("stem.gpqa", []), ("stem.gpqa", ["--name", "gpqa_diamond"]),
]


@pytest.mark.parametrize("module, arguments", RUNS, ids=[f"{m}{''.join(a)}" for m, a in RUNS])
def test_every_preprocessed_row_scores_one_with_its_own_answer(module, arguments, tmp_path):
    rows = _rows(_run_script(module, tmp_path, *arguments))
    assert rows
    for row in rows:
        source, truth, extra = row["data_source"], row["reward_model"]["ground_truth"], row["extra_info"]
        assert get_reward_fn(source).__module__ == f"rl360.rewards.{module.split('.')[0]}", source
        assert _score(source, _correct_response(source, truth, extra), truth, extra) == 1.0, (source, truth)
        assert _score(source, "<answer>zzz</answer> \\boxed{zzz} {\"output\": \"zzz\"}", truth, extra) == 0.0
        assert _score(source, "", truth, extra) == 0.0


def test_round_trip_partial_and_alternative_answers(tmp_path):
    zebra = _rows(_run_script("logic.zebra_puzzle", tmp_path))[0]
    grid = json.loads(zebra["reward_model"]["ground_truth"])
    grid["rows"][0][2] = "dog"  # one of six cells wrong
    assert _score(zebra["data_source"], f"<answer>{json.dumps(grid)}</answer>",
                  zebra["reward_model"]["ground_truth"]) == pytest.approx(5 / 6)
    hitab = _rows(_run_script("table.hitab", tmp_path))[1]
    assert _score(hitab["data_source"], "\\boxed{2020|2019}", hitab["reward_model"]["ground_truth"]) == 1.0
    finqa = _rows(_run_script("table.finqa", tmp_path))[0]  # truth "33.3%"
    for answer in ("33.3", "0.333", "33.3\\%"):
        assert _score(finqa["data_source"], f"\\boxed{{{answer}}}", finqa["reward_model"]["ground_truth"]) == 1.0
    crux = _rows(_run_script("simulation.cruxeval", tmp_path, "--task", "input"))[1]  # f([3, -1, 2], 2) == [6, 4]
    assert _score(crux["data_source"], "<answer>[3, 2], 2</answer>", crux["reward_model"]["ground_truth"],
                  crux["extra_info"]) == 1.0  # another input with the same output, checked in the sandbox
