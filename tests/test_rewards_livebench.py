"""ood__livebench: every task with a right, a wrong and (where LiveBench gives partial credit) a partly right
answer, in the answer formats LiveBench's prompts ask for; rows shaped as Reasoning360's preprocessing writes
them."""

import json
from datetime import datetime

import pytest

from rl360.rewards.livebench import SCORERS, livebench_score
from rl360.rewards.livebench.language import edit_distance
from rl360.rewards.livebench.tables import read_table, tables_equal
from rl360.rewards.registry import get_reward_fn

OLD = datetime(2024, 6, 24)  # inside Reasoning360's June-July 2024 window
NEW = datetime(2025, 4, 25)


def _extra(task, prompt="", date=OLD, category="reasoning"):
    return {"category": category, "task": task, "prompt": [prompt], "date": date}


def _score(task, response, truth, **extra):
    return livebench_score(response, truth, _extra(task, **extra))["score"]


def test_registered_for_the_data_source_and_returns_score_and_acc():
    assert get_reward_fn("ood__livebench") is livebench_score
    result = livebench_score("**yes, no, yes**", "yes, no, yes", _extra("web_of_lies_v2"))
    assert result == {"score": 1.0, "acc": 1.0}


def test_every_task_reasoning360_routes_has_a_scorer():
    routed = {"cta", "tablejoin", "tableformat", "web_of_lies_v2", "web_of_lies_v3", "house_traversal",
              "zebra_puzzle", "spatial", "plot_unscrambling", "typos", "connections"}
    assert routed <= set(SCORERS)


@pytest.mark.parametrize("extra", [None, {}, {"task": "sudoku"}, {"task": ["cta"]}])
def test_unknown_or_missing_task_is_an_error_naming_the_known_tasks(extra):
    with pytest.raises(ValueError, match="known tasks: .*'connections'"):
        livebench_score("x", "y", extra)


def test_thinking_is_dropped_before_the_answer_is_read():
    response = "<think>maybe <solution>yes, yes, yes</solution></think>So: **no, yes, yes**"
    assert _score("web_of_lies_v2", response, "no, yes, yes") == 1.0


# ----- data analysis ------------------------------------------------------------------------------------

CTA_PROMPT = ("Pick the column's class based on the provided column sample. Choose exactly one of the listed "
              "classes. Please respond only with the name of the class. \n Column sample: [['2023-11-16T00:00:00.000'],"
              " ['2022-06-16T00:00:00.000']] \n Classes: ['permit_type' 'inspection_date' 'location'] \n Output: \n")


@pytest.mark.parametrize(("response", "expected"), [
    ("inspection_date", 1.0),
    ("Inspection_Date.", 1.0),
    ("The class is: inspection_date", 1.0),  # LiveBench accepts an answer ending with the class
    ("\\boxed{\\text{inspection\\_date}}", 1.0),
    ("permit_type", 0.0),
    ("inspection_date or permit_type", 0.0),
])
def test_cta(response, expected):
    assert _score("cta", response, "inspection_date", prompt=CTA_PROMPT, category="data_analysis") == expected


JOIN_TRUTH = "{'vehicle_make': 'make', 'price_usd': 'cost', 'zip': 'postcode'}"


@pytest.mark.parametrize(("response", "expected"), [
    ("{'vehicle_make': 'make', 'price_usd': 'cost', 'zip': 'postcode'}", 1.0),
    ('```python\n{"vehicle_make": "make",\n "price_usd": "cost", "zip": "postcode", "year": null}\n```', 1.0),
    ("<solution>{'zip': 'postcode', 'price_usd': 'cost', 'vehicle_make': 'make'}</solution>", 1.0),
    ("{'vehicle_make': 'make', 'price_usd': 'cost'}", 0.8),  # tp 2, fn 1: 4 / 5
    ("{'vehicle_make': 'make', 'price_usd': 'postcode', 'zip': 'cost'}", 0.33),  # tp 1, fp 2, fn 2: 2 / 6
    ("{'vehicle_make': 'model', 'price_usd': 'postcode'}", 0.0),
    ("The columns vehicle_make and make match.", 0.0),
])
def test_tablejoin_is_the_f1_of_the_pairs(response, expected):
    assert _score("tablejoin", response, JOIN_TRUTH, category="data_analysis") == expected


def test_tablejoin_truth_may_be_a_dict_but_not_a_list():
    truth = {"vehicle_make": "make", "price_usd": "cost", "zip": "postcode"}
    assert _score("tablejoin", "{'vehicle_make': 'make'}", truth) == 0.5
    with pytest.raises(ValueError, match="tablejoin: ground truth must be a dict"):
        _score("tablejoin", "{}", "['vehicle_make']")


def _reformat_prompt(source, target):
    return (f"Please convert the Input Table from {source} format to {target} format. Please respond only with "
            "the table. \n Input Table: ...\n Output: \n")


CSV_TRUTH = "id,name,score\n1,Ann,3.5\n2,Bo & Co,4.0\n"
JSON_TRUTH = json.dumps({"14": {"id": 1, "name": "Ann", "score": 3.5}, "7": {"id": 2, "name": "Bo & Co", "score": 4}})
JSONL_TRUTH = '{"id":1,"name":"Ann","score":3.5}\n{"id":2,"name":"Bo & Co","score":4.0}\n'
HTML_TRUTH = ('<table border="1" class="dataframe">\n  <thead>\n    <tr style="text-align: right;">\n      <th>id</th>'
              "\n      <th>name</th>\n      <th>score</th>\n    </tr>\n  </thead>\n  <tbody>\n    <tr>\n"
              "      <td>1</td>"
              "\n      <td>Ann</td>\n      <td>3.5</td>\n    </tr>\n    <tr>\n      <td>2</td>\n      <td>Bo &amp; Co"
              "</td>\n      <td>4.0</td>\n    </tr>\n  </tbody>\n</table>")
MARKDOWN_TRUTH = "| id | name | score |\n|---:|:-----|------:|\n| 1 | Ann | 3.5 |\n| 2 | Bo & Co | 4.0 |"


@pytest.mark.parametrize(("target", "truth", "response"), [
    ("CSV", CSV_TRUTH, "```csv\nid,name,score\n1,Ann,3.5\n2,Bo & Co,4\n```"),
    ("CSV", CSV_TRUTH, "Here is the converted table:\nid,name,score\n1,Ann,3.50\n2,Bo &amp; Co,4.0"),
    ("CSV", CSV_TRUTH, "Sure.\n\nid,name,score\n1,Ann,3.5\n2,Bo & Co,4.0\n\nLet me know if you need more."),
    ("TSV", CSV_TRUTH.replace(",", "\t"), "id\tname\tscore\n1\tAnn\t3.5\n2\tBo & Co\t4.0"),
    ("JSON", JSON_TRUTH, '[{"name": "Ann", "id": 1, "score": 3.5}, {"name": "Bo & Co", "id": 2, "score": 4.0}]'),
    ("JSON", JSON_TRUTH, '```json\n{"0": {"id": 1, "name": "Ann", "score": 3.5}, "1": {"id": 2, "name": "Bo & Co",'
                         ' "score": 4.0}}\n```'),
    ("JSONL", JSONL_TRUTH, '{"id": 1, "name": "Ann", "score": 3.5}\n{"id": 2, "name": "Bo & Co", "score": 4}'),
    ("HTML", HTML_TRUTH, "<table><tr><th>name</th><th>id</th><th>score</th></tr><tr><td>Ann</td><td>1</td><td>3.5"
                         "</td></tr><tr><td>Bo &amp; Co</td><td>2</td><td>4</td></tr></table>"),
    ("Markdown", MARKDOWN_TRUTH, "|id|name|score|\n|--|--|--|\n|1|Ann|3.5|\n|2|Bo & Co|4|"),
])
def test_tableformat_right_tables_in_each_target_format(target, truth, response):
    prompt = _reformat_prompt("TSV" if target != "TSV" else "CSV", target)
    assert _score("tableformat", response, truth, prompt=prompt, category="data_analysis") == 1.0


@pytest.mark.parametrize(("target", "truth", "response"), [
    ("CSV", CSV_TRUTH, "id,name,score\n1,Ann,3.5\n2,Bo & Co,4.5"),  # a changed value
    ("CSV", CSV_TRUTH, "id,name,score\n1,Ann,3.5"),  # a row missing
    ("CSV", CSV_TRUTH, "id,name,points\n1,Ann,3.5\n2,Bo & Co,4.0"),  # a renamed column
    ("CSV", CSV_TRUTH, "id,name,score\n2,Bo & Co,4.0\n1,Ann,3.5"),  # rows out of order
    ("JSON", JSON_TRUTH, '[{"id": 1, "name": "Ann", "score": 3.5}]'),
    ("JSONL", JSONL_TRUTH, "id,name,score\n1,Ann,3.5\n2,Bo & Co,4.0"),  # the wrong format
    ("HTML", HTML_TRUTH, "<table><tr><td>id</td><td>name</td><td>score</td></tr></table>"),
    ("Markdown", MARKDOWN_TRUTH, "| id | name |\n|---|---|\n| 1 | Ann |\n| 2 | Bo & Co |"),
])
def test_tableformat_wrong_tables(target, truth, response):
    prompt = _reformat_prompt("TSV", target)
    assert _score("tableformat", response, truth, prompt=prompt, category="data_analysis") == 0.0


def test_tableformat_reads_the_newer_target_format_line_and_livebench_task_name():
    prompt = "Convert the table.\nSource Format: tsv\nTarget Format: jsonl\n"
    response = '<solution>\n{"id":1,"name":"Ann","score":3.5}\n{"id":2,"name":"Bo & Co","score":4.0}\n</solution>'
    assert _score("tablereformat", response, JSONL_TRUTH, prompt=prompt) == 1.0


def test_tableformat_needs_the_question_and_a_readable_truth():
    with pytest.raises(ValueError, match=r"extra_info\['prompt'\]"):
        livebench_score("x", CSV_TRUTH, {"task": "tableformat"})
    with pytest.raises(ValueError, match="names no target format"):
        _score("tableformat", "x", CSV_TRUTH, prompt="Convert this table.")
    with pytest.raises(ValueError, match="not a json table"):
        _score("tableformat", "x", "not json", prompt=_reformat_prompt("CSV", "JSON"))


def test_table_cells_compare_numbers_with_a_tolerance_and_missing_cells_alike():
    wanted = read_table("a,b\n1.0000001,\n", "csv")
    assert tables_equal(read_table("b,a\nNaN,1\n", "csv"), wanted)
    assert not tables_equal(read_table("a,b\n1.1,\n", "csv"), wanted)
    assert read_table("a,b\n1,2,3\n", "csv") is None  # a row longer than the header


# ----- reasoning ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("response", "expected"), [
    ("Step by step ... so the answers are **no, yes, yes**.", 1.0),
    ("Does Ryan tell the truth? **No**. Does Ka? **Yes**. Does Ana? **Yes**.", 1.0),
    ("Thinking done.\n<solution>no, yes, yes</solution>", 1.0),
    ("\\boxed{\\text{no, yes, yes}}", 1.0),
    ("Putting it together: no, yes, yes", 1.0),
    ("**no, no, yes**", 0.0),
    ("**no, yes**", 0.0),
    ("**no, unknown, yes**", 0.0),
    ("I cannot tell.", 0.0),
])
def test_web_of_lies_v2(response, expected):
    assert _score("web_of_lies_v2", response, "no, yes, yes") == expected


@pytest.mark.parametrize(("response", "expected"), [
    ("<solution>yes, no, unknown</solution>", 1.0),
    ("<solution>**Yes**, no, unknown</solution>", 1.0),
    ("\\boxed{yes, no, unknown}", 1.0),
    ("<solution>yes, no, yes</solution>", pytest.approx(1 / 3)),  # 2 of 3 right: (0 + 2/3) / 2
    ("<solution>yes</solution>", pytest.approx(1 / 6)),
    ("<solution>no, yes, yes</solution>", 0.0),
    ("no idea", 0.0),
])
def test_web_of_lies_v3_partial_credit_by_position(response, expected):
    assert _score("web_of_lies_v3", response, "yes, no, unknown") == expected


def test_web_of_lies_truth_must_be_verdicts():
    with pytest.raises(ValueError, match="yes/no/unknown"):
        _score("web_of_lies_v2", "**yes**", "maybe, yes, no")


@pytest.mark.parametrize(("response", "expected"), [
    ("The shortest route passes **Kathy**, then **Matthew**, then **Ruth**.", 1.0),
    ("Answer: **Kathy, Matthew, Ruth**", 1.0),
    ("Answer: **kathy matthew ruth**", 1.0),
    ("Answer: **Ruth, Matthew, Kathy**", 0.0),
    ("Answer: **Kathy, Ruth**", 0.0),
    ("Kathy, Matthew, Ruth", 0.0),  # the names must be in bold
])
def test_house_traversal(response, expected):
    assert _score("house_traversal", response, "Kathy Matthew Ruth") == expected


def test_house_traversal_names_may_repeat():
    assert _score("house_traversal", "**Kathy, Ruth, Kathy**", "Kathy Ruth Kathy") == 1.0
    assert _score("house_traversal", "**Kathy, Ruth**", "Kathy Ruth Kathy") == 0.0


@pytest.mark.parametrize(("response", "truth", "expected"), [
    ("The person who likes cricket is in position ***3***.", "3", 1.0),
    ("So the answer is ***3***.", "three", 1.0),
    ("***horror***", "horror movies", 1.0),
    ("Therefore the fan of cricket lives at 3", "3", 1.0),  # no bold: the last word
    ("***4***. I double-checked: not 3", "3", 0.0),
    ("The answer is 3, I think not", "3", 0.0),
])
def test_zebra_puzzle_before_the_format_change_one_answer(response, truth, expected):
    assert _score("zebra_puzzle", response, truth, date=OLD) == expected


@pytest.mark.parametrize(("response", "expected"), [
    ("<solution>3, cricket, red</solution>", 1.0),
    ("<solution>position 3, Cricket, red</solution>", 1.0),
    ("\\boxed{3, cricket, red}", 1.0),
    ("Final answer:\n3,cricket,red", 1.0),
    ("<solution>3, cricket, blue</solution>", pytest.approx(1 / 3)),  # (0 + 2/3) / 2
    ("<solution>3</solution>", pytest.approx(1 / 6)),
    ("<solution>1, golf</solution> No, rather: <solution>3, cricket, red</solution>", 1.0),  # the last cells
    ("<solution>13, golf, red</solution>", pytest.approx(1 / 6)),  # "3" is not found in "13"
    ("no solution tag", 0.0),
])
def test_zebra_puzzle_after_the_format_change_scores_each_cell(response, expected):
    assert _score("zebra_puzzle", response, "3,cricket,red", date=NEW) == expected


def test_zebra_puzzle_without_a_date_reads_a_comma_truth_as_cells():
    def score(response, truth, **row):
        return livebench_score(response, truth, {"task": "zebra_puzzle", **row})["score"]

    assert score("<solution>3, cricket, blue</solution>", "3,cricket,red") == pytest.approx(1 / 3)
    assert score("***3***", "3") == 1.0
    assert score("<solution>3</solution>", "3") == 0.0  # one answer: its last word is "solution"
    assert score("<solution>3</solution>", "3", date="2025-01-01") == 1.0


def test_release_date_must_be_a_date():
    with pytest.raises(ValueError, match=r"extra_info\['date'\] is not a date"):
        _score("zebra_puzzle", "***3***", "3", date="soon")


@pytest.mark.parametrize(("response", "truth", "expected"), [
    ("After the cuts there are **3** pieces.", "3", 1.0),
    ("After the cuts there are **three** pieces.", "3", 1.0),
    ("**3** pieces, so **yes**, it is **final**", "3", 1.0),  # one of the last three bold spans
    ("\\boxed{\\textbf{3}}", "3", 1.0),
    ("The shape is an **equilateral triangle**.", "triangle", 1.0),
    ("**circle, square, triangle**", "triangle", 0.0),
    ("There are **4** pieces.", "3", 0.0),
    ("There are 3 pieces.", "3", 0.0),
])
def test_spatial(response, truth, expected):
    assert _score("spatial", response, truth) == expected


# ----- language -----------------------------------------------------------------------------------------

PLOT = ("Mara finds an old map in the attic. She sails to the island with her brother. A storm wrecks their boat. "
        "They build a raft from the wreckage. A fishing crew rescues them at dawn.")


def test_plot_unscrambling_right_order_scores_one():
    response = f"<PLOT_SUMMARY>{PLOT}</PLOT_SUMMARY>"
    assert _score("plot_unscrambling", response, PLOT, category="language") == 1.0


def test_plot_unscrambling_partial_credit_from_the_edit_distance_of_the_order():
    sentences = [s.strip() for s in PLOT.split(".") if s.strip()]
    swapped = [sentences[1], sentences[0]] + sentences[2:]  # one adjacent swap: distance 2 of 5 sentences
    response = "Here it is:\n<PLOT_SUMMARY>" + ". ".join(swapped) + ".\n**End of Plot Summary**"
    assert _score("plot_unscrambling", response, PLOT) == pytest.approx(1 - 2 / 5)
    reversed_order = ". ".join(reversed(sentences)) + "."
    assert _score("plot_unscrambling", reversed_order, PLOT) == pytest.approx(1 - 4 / 5)
    assert _score("plot_unscrambling", "<PLOT_SUMMARY></PLOT_SUMMARY>", PLOT) == 0.0


def test_edit_distance():
    assert edit_distance([0, 1, 2, 3], [0, 1, 2, 3]) == 0
    assert edit_distance([0, 1, 2], [1, 0, 2]) == 2
    assert edit_distance([0, 1, 2], []) == 3
    assert edit_distance(list("kitten"), list("sitting")) == 3


TYPOS_TRUTH = "We study the effect of weight decay on the generalisation of deep networks."


@pytest.mark.parametrize(("response", "expected"), [
    (f"<solution>{TYPOS_TRUTH}</solution>", 1.0),
    (TYPOS_TRUTH, 1.0),
    ("We study the effect of weight decay\non the generalisation of deep networks.", 1.0),
    (f"Corrected: --- {TYPOS_TRUTH} --- done", 1.0),
    ("<solution>We study the efect of weight decay on the generalisation of deep networks.</solution>", 0.0),
    (f"<solution>{TYPOS_TRUTH[:40]}</solution>", 0.0),
])
def test_typos(response, expected):
    assert _score("typos", response, TYPOS_TRUTH, category="language") == expected


CONNECTIONS = "bass, pike, carp, sole, drum, harp, horn, lute, mars, venus, earth, pluto, jack, king, queen, ace"
GROUPS = [w.strip() for w in CONNECTIONS.split(",")]


def _bold_list(words):
    return "**" + ", ".join(words) + "**"


def test_connections_before_the_format_change_reads_bold_lists():
    assert _score("connections", "Groups: " + _bold_list(GROUPS), CONNECTIONS, category="language") == 1.0
    assert _score("connections", _bold_list([w.upper() for w in GROUPS]), CONNECTIONS) == 1.0
    two_swapped = GROUPS[:3] + [GROUPS[4], GROUPS[3]] + GROUPS[5:]  # breaks the first two groups
    assert _score("connections", _bold_list(two_swapped), CONNECTIONS) == 0.5
    assert _score("connections", _bold_list(GROUPS[::-1][:4]), CONNECTIONS) == 0.25
    assert _score("connections", ", ".join(GROUPS), CONNECTIONS) == 0.0  # not bold


def test_connections_after_the_format_change_reads_the_solution_tag():
    right = "<solution>" + ", ".join(GROUPS) + "</solution>"
    assert _score("connections", right, CONNECTIONS, date=NEW) == 1.0
    assert _score("connections", "\\boxed{" + ", ".join(GROUPS) + "}", CONNECTIONS, date=NEW) == 1.0
    one_swapped = GROUPS[:12] + [GROUPS[3]] + GROUPS[13:]
    assert _score("connections", "<solution>" + ", ".join(one_swapped) + "</solution>", CONNECTIONS,
                  date=NEW) == 0.75
    repeated = "<solution>" + ", ".join(GROUPS[:4] * 4) + "</solution>"
    assert _score("connections", repeated, CONNECTIONS, date=NEW) == 0.25  # one right group, counted once
    assert _score("connections", _bold_list(GROUPS), CONNECTIONS, date=NEW) == 0.0
