"""Logic, simulation, table, stem and format rewards: correct, wrong, partial and malformed answers, and a
round trip through each preprocessing script's rows."""

import json

import pytest

from rl360.rewards import compute_score, get_reward_fn
from rl360.rewards.format import LEWIS_SPEAKER_TAGS, length_score, one_sentence, tag_content, tags_format, think_format
from rl360.rewards.stem import chosen_letter
from tests.test_preprocess import SCRIPTS, _rows, _run_script

ZEBRA = json.dumps({"header": ["House", "Name", "Pet"], "rows": [["1", "Alice", "cat"], ["2", "Bob", "dog"]]})


def _score(source, response, truth, extra=None):
    result = compute_score(source, response, truth, extra)
    return result["score"] if isinstance(result, dict) else result


def test_zebra_gives_credit_per_cell():
    grid = {"header": ["House", "Name", "Pet"], "rows": [["1", "alice", "Cat"], ["2", "Bob", "dog"]]}
    right = f"<answer>{json.dumps(grid)}</answer>"
    assert _score("logic__zebra_puzzle", right, ZEBRA) == 1.0
    one_off = "<think>hmm</think><answer>[[\"1\", \"Alice\", \"dog\"], [\"2\", \"Bob\", \"dog\"]]</answer>"
    assert _score("logic__zebra_puzzle", one_off, ZEBRA) == pytest.approx(5 / 6)
    short = '<answer>{"rows": [["1", "Alice", "cat"]]}</answer>'
    assert _score("logic__zebra_puzzle", short, ZEBRA) == pytest.approx(3 / 6)
    for bad in ["no tag at all", "<answer>not json</answer>", "<answer>42</answer>", ""]:
        assert _score("logic__zebra_puzzle", bad, ZEBRA) == 0.0
    with pytest.raises(ValueError, match="logic__zebra_puzzle"):
        _score("logic__zebra_puzzle", right, "{broken")


def test_ordering_and_graph():
    truth = json.dumps(["red", "green", "blue"])
    assert _score("logic__ordering_puzzle", "<answer>['Red', 'green', 'blue']</answer>", truth) == 1.0
    assert _score("logic__ordering_puzzle", "<answer>red, green, blue</answer>", truth) == 1.0
    swapped = compute_score("logic__ordering_puzzle", "<answer>[\"red\", \"blue\", \"green\"]</answer>", truth)
    assert swapped["score"] == 0.0 and swapped["position_accuracy"] == pytest.approx(1 / 3)
    assert _score("logic__ordering_puzzle", "red green blue", truth) == 0.0
    assert _score("logic__graph_search", "<think>path</think><answer> B </answer>", "B") == 1.0
    assert _score("logic__graph_search", "<answer>C</answer>", "B") == 0.0


def test_codeio_compares_the_last_json_object():
    truth = json.dumps({"output": {"total": 6, "items": [1, 2, 3]}})
    good = 'Tracing it: {"x": 1} then finally {"output": {"total": 6.0, "items": [1, 2, 3]}}'
    assert _score("simulation__codeio", good, truth) == 1.0
    assert _score("simulation__codeio", '{"output": {"total": 7, "items": [1, 2, 3]}}', truth) == 0.0
    assert _score("simulation__codeio", '{"input": {"total": 6, "items": [1, 2, 3]}}', truth) == 0.0
    assert _score("simulation__codeio", "no json", truth) == 0.0


def test_cruxeval_output_and_input_prediction():
    truth = json.dumps({"code": "def f(s, n):\n    return s * n", "input": "'ab', 2", "output": "'abab'"})
    assert _score("simulation__cruxeval_o", "<answer>'abab'</answer>", truth, {"task": "output"}) == 1.0
    assert _score("simulation__cruxeval_o", '<answer>"abab"</answer>', truth, {"task": "output"}) == 1.0
    assert _score("simulation__cruxeval_o", "<answer>'ab'</answer>", truth, {"task": "output"}) == 0.0
    assert _score("simulation__cruxeval_i", "<answer>'a', 4</answer>", truth, {"task": "input"}) == 0.0
    assert _score("simulation__cruxeval_i", "<answer>'ab', 2</answer>", truth, {"task": "input"}) == 1.0
    assert _score("simulation__cruxeval_i", "<answer>)(</answer>", truth, {"task": "input"}) == 0.0


def test_arcagi_grid_must_match_cell_for_cell():
    truth = json.dumps([[0, 1], [1, 0]])
    assert _score("simulation__arcagi", "The grid is [[0, 1], [1, 0]].", truth) == 1.0
    assert _score("simulation__arcagi", "<answer>[[0,1],[1,0]]</answer> and later [[5]]", truth) == 1.0
    assert _score("simulation__arcagi", "<answer>[[0, 1], [1, 1]]</answer>", truth) == 0.0
    assert _score("simulation__arcagi", "[[0, 1]]", truth) == 0.0
    with pytest.raises(ValueError, match="list of lists of ints"):
        _score("simulation__arcagi", "x", json.dumps({"grid": 1}))


@pytest.mark.parametrize("pred, truth, expected", [
    ("1,234.5", "1234.5", 1.0), ("$3", "3", 1.0), ("14.1\\%", "14.1%", 1.0), ("0.141", "14.1%", 1.0),
    ("14.1", "0.141", 0.0), ("3.14159", "3.1416", 1.0), ("3.2", "3.1", 0.0), ("Paris", " paris. ", 1.0),
    ("b|a", "a|b", 1.0), ("a", "a|b", 0.0), ("a|b|c", "a|b", 0.0),
])
def test_table_numeric_tolerance_and_lists(pred, truth, expected):
    assert _score("table__finqa", f"so \\boxed{{{pred}}}", truth) == expected


def test_table_needs_a_boxed_answer():
    assert _score("table__hitab", "the answer is 3", "3") == 0.0


@pytest.mark.parametrize("response, letter", [
    ("\\boxed{B}", "B"), ("\\boxed{(C)}", "C"), ("\\boxed{D. 42 kg}", "D"), ("so the answer is (A)", "A"),
    ("Answer: c", "C"), ("<think>\\boxed{A}</think> \\boxed{B}", "B"), ("\\boxed{42}", None), ("no idea", None),
])
def test_multiple_choice_letter(response, letter):
    assert chosen_letter(response) == letter


def test_stem_multiple_choice_and_free_form():
    assert _score("stem__gpqa", "\\boxed{B}", "B") == 1.0
    assert _score("stem__gpqa", "\\boxed{C}", "B") == 0.0
    assert _score("stem__webinstruct", "\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert _score("stem__webinstruct", "\\boxed{2}", "0.5") == 0.0


def test_format_rewards():
    assert think_format("<think>plan</think> The answer is 4.") == 1.0
    for bad in ["The answer is 4.", "<think>a</think>", "<think>a</think> x <think>b</think> y",
                "x <think>a</think> y"]:
        assert think_format(bad) == 0.0
    lewis = "<thinking>it is a dog</thinking>\n<coarse>A photo of a dog</coarse>\n<detailed>A golden dog.</detailed>"
    assert tags_format(lewis, LEWIS_SPEAKER_TAGS) == 1.0
    assert tag_content(lewis, "detailed") == "A golden dog."
    for bad in [lewis.replace("</coarse>", ""), lewis + "<coarse>again</coarse>",
                "<coarse>x</coarse><thinking>y</thinking><detailed>z</detailed>", "extra " + lewis]:
        assert tags_format(bad, LEWIS_SPEAKER_TAGS) == 0.0
    assert one_sentence("A golden dog with a red collar.") == 1.0
    assert one_sentence("A dog. It is golden.") == 0.0
    assert [length_score(n, 100, 10) for n in (100, 110, 115, 120, 200)] == [1.0, 1.0, 0.5, 0.0, 0.0]


def _correct_response(source, truth, extra):
    if source.startswith(("logic__", "simulation__cruxeval")):
        value = json.loads(truth)["output"] if source.startswith("simulation__cruxeval") else truth
        return f"<think>work</think><answer>{value}</answer>"
    if source.startswith("simulation__codeio"):
        return f"The result is {truth}"
    return f"<think>work</think> so \\boxed{{{truth}}}"


@pytest.mark.parametrize("module", [m for m in sorted(SCRIPTS) if m.split(".")[0] in ("logic", "simulation",
                                                                                         "table", "stem")])
def test_every_preprocessed_row_scores_one_with_its_own_answer(module, tmp_path):
    rows = _rows(_run_script(module, tmp_path))
    assert rows
    for row in rows:
        source, truth = row["data_source"], row["reward_model"]["ground_truth"]
        fn = get_reward_fn(source)
        assert fn.__module__.split(".")[-1] == module.split(".")[0], (source, fn)
        assert _score(source, _correct_response(source, truth, row["extra_info"]), truth, row["extra_info"]) == 1.0
        assert _score(source, "<answer>zzz</answer> \\boxed{zzz}", truth, row["extra_info"]) < 1.0
