"""reasoning_gym: real entries made by the reasoning-gym package, stored as Reasoning360's scorer reads them (the
answer as ground truth, the task and JSON metadata in extra_info, or the whole entry as ground truth), scored
through our reward: the entry's own answer earns 1, a wrong one 0, a partly right one the package's partial
credit."""

import functools
import json

import pytest
import reasoning_gym

from rl360.rewards.reasoning_gym import extract_answer, reasoning_gym_score
from rl360.rewards.registry import get_reward_fn


@functools.cache
def _entries(task: str) -> tuple:
    return tuple(reasoning_gym.create_dataset(task, size=3, seed=1))


def _row(entry, task):
    """(ground_truth, extra_info) as a reasoning_gym parquet row holds them."""
    return entry["answer"], {"task": task, "metadata": json.dumps(entry["metadata"])}


def _tagged(answer):
    return f"<think>Let me work it out.</think>\n<answer>{answer}</answer>"


def test_registered_for_the_exact_data_source():
    assert get_reward_fn("reasoning_gym") is reasoning_gym_score
    with pytest.raises(KeyError):
        get_reward_fn("reasoning_gym_v2")


@pytest.mark.parametrize("task", ["basic_arithmetic", "word_sorting", "knights_knaves", "spell_backward"])
def test_the_entrys_answer_scores_one_and_a_wrong_answer_zero(task):
    for entry in _entries(task):
        truth, extra = _row(entry, task)
        right = reasoning_gym_score(_tagged(entry["answer"]), truth, extra)
        assert right["score"] == 1.0 and right["acc"] == 1.0 and right["pred"] == entry["answer"]
        assert reasoning_gym_score(_tagged("#"), truth, extra)["score"] == 0.0  # shares no character with any


def test_partial_credit_is_the_packages():
    entry = _entries("knights_knaves")[0]  # "Amelia is a hero, and Elizabeth is a hero."
    names = entry["metadata"]["names"]
    truth, extra = _row(entry, "knights_knaves")
    flipped = entry["answer"].replace(f"{names[1]} is a hero", f"{names[1]} is a villain")
    assert flipped != entry["answer"]
    assert reasoning_gym_score(_tagged(flipped), truth, extra)["score"] == pytest.approx(0.3 + 0.7 / 2)


def test_metadata_is_what_word_sorting_scores_against():
    entry = _entries("word_sorting")[0]
    truth, extra = _row(entry, "word_sorting")
    assert reasoning_gym_score(_tagged(entry["answer"]), truth, {**extra, "metadata": entry["metadata"]})["score"] == 1
    without = reasoning_gym_score(_tagged(entry["answer"]), truth, {"task": "word_sorting"})
    assert without["score"] == 0.0 and "KeyError" in without["error"]


def test_extra_info_as_json_text_and_the_whole_entry_as_ground_truth():
    entry = _entries("basic_arithmetic")[1]
    truth, extra = _row(entry, "basic_arithmetic")
    assert reasoning_gym_score(_tagged(truth), truth, json.dumps(extra))["score"] == 1.0
    assert reasoning_gym_score(_tagged(truth), dict(entry), None)["score"] == 1.0  # task from source_dataset
    assert reasoning_gym_score(_tagged(truth), {**entry, "task": "basic_arithmetic"}, {})["score"] == 1.0
    assert reasoning_gym_score(_tagged(truth), "0", {"task": "basic_arithmetic", "entry": dict(entry)})["score"] == 1


def test_the_callers_entry_is_not_modified():
    entry = dict(_entries("basic_arithmetic")[0])
    before = json.dumps(entry, sort_keys=True, default=str)
    reasoning_gym_score(_tagged(entry["answer"]), entry, {"metadata": {"extra": 1}})
    assert json.dumps(entry, sort_keys=True, default=str) == before


def test_game_of_life_halting_needs_the_right_verdict():
    entry = _entries("game_of_life_halting")[0]
    truth, extra = _row(entry, "game_of_life_halting")
    other = "True" if truth == "False" else "False"
    assert reasoning_gym_score(_tagged(truth.lower()), truth, extra)["score"] == 1.0
    assert reasoning_gym_score(_tagged(other), truth, extra)["score"] == 0.0  # the package alone gives 1.0


def test_puzzle24_small_credit_only_for_an_arithmetic_attempt():
    # an entry as puzzle24 writes it (generating one takes a second; its scorer reads only the answer)
    entry = {"question": "Make 24 using 4, 8, 6, 2.", "answer": "4*8 - 6 - 2",
             "metadata": {"source_dataset": "puzzle24", "numbers": [4, 8, 6, 2]}}
    truth, extra = _row(entry, "puzzle24")
    assert reasoning_gym_score(_tagged(truth), truth, extra)["score"] == 1.0
    assert reasoning_gym_score(_tagged("1 + 2 + 3 + 4"), truth, extra)["score"] == 0.01
    assert reasoning_gym_score(_tagged("no idea"), truth, extra)["score"] == 0.0


@pytest.mark.parametrize(("response", "answer"), [
    ("<answer>a</answer> then <answer> b </answer>", "b"),
    ("<think><answer>x</answer></think>The answer: <b>42</b>", "The answer: 42"),
    ("<think>x</think>", ""),
    ("  42  ", "42"),
])
def test_extract_answer(response, answer):
    assert extract_answer(response) == answer


def test_a_row_without_a_task_names_where_it_looked():
    with pytest.raises(ValueError, match=r"extra_info\['task'\].*ground_truth\['task'\].*source_dataset"):
        reasoning_gym_score("<answer>1</answer>", "1", {"metadata": "{}"})


def test_an_unknown_task_or_malformed_extra_info_is_an_error():
    with pytest.raises(ValueError, match="'no_such_task' is not a reasoning-gym dataset"):
        reasoning_gym_score("<answer>1</answer>", "1", {"task": "no_such_task"})
    with pytest.raises(ValueError, match="extra_info is text but not JSON"):
        reasoning_gym_score("<answer>1</answer>", "1", "task=basic_arithmetic")
    with pytest.raises(ValueError, match=r"extra_info\['metadata'\] must be a dict"):
        reasoning_gym_score("<answer>1</answer>", "1", {"task": "basic_arithmetic", "metadata": [1]})


def test_a_missing_package_stops_the_data_check(monkeypatch):
    from rl360.rewards import registry

    assert registry.check_route("reasoning_gym").requires == "reasoning-gym"  # installed here: no error
    real = registry.importlib.util.find_spec
    monkeypatch.setattr(registry.importlib.util, "find_spec",
                        lambda name: None if name == "reasoning_gym" else real(name))
    with pytest.raises(registry.MissingRequirement, match="pip install reasoning-gym"):
        registry.check_route("reasoning_gym")
