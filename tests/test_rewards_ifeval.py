"""IFEval's 25 instruction checks, the shared text utilities, and the `ood__ifeval` / `ood__ifbench` scorer.

Responses follow the prompts of IFEval's public data set (Zhou et al. 2023) and its paper's examples.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from rl360.rewards import compute_score
from rl360.rewards.instructions import INSTRUCTION_CHECKS, parse_instructions
from rl360.rewards.instructions.ifeval import IFEVAL_CHECKS
from rl360.rewards.instructions.text import (
    count_paragraphs,
    count_sentences,
    count_words,
    lowercase_ratio,
    paragraphs,
    sentences,
    uppercase_ratio,
    words,
)

IFEVAL_IDS = {
    "keywords:existence", "keywords:frequency", "keywords:forbidden_words", "keywords:letter_frequency",
    "language:response_language", "length_constraints:number_sentences", "length_constraints:number_paragraphs",
    "length_constraints:number_words", "length_constraints:nth_paragraph_first_word",
    "detectable_content:number_placeholders", "detectable_content:postscript",
    "detectable_format:number_bullet_lists", "detectable_format:constrained_response",
    "detectable_format:number_highlighted_sections", "detectable_format:multiple_sections",
    "detectable_format:json_format", "detectable_format:title", "combination:two_responses",
    "combination:repeat_prompt", "startend:end_checker", "startend:quotation",
    "change_case:capital_word_frequency", "change_case:english_capital", "change_case:english_lowercase",
    "punctuation:no_comma",
}


def check(instruction_id: str, response: str, **kwargs) -> bool:
    return IFEVAL_CHECKS[instruction_id](response, **kwargs)


# ----------------------------------------------------------------------------------------------------------
# text utilities


def test_words_are_runs_of_word_characters():
    assert words("Don't stop: 3.14 state-of-the-art!") == ["Don", "t", "stop", "3", "14", "state", "of", "the", "art"]
    assert count_words("  **bold** _under_ -- ... ") == 2
    assert count_words("") == 0


def test_sentences_skip_abbreviations_initials_decimals_and_list_markers():
    text = ("Mr. Smith paid $3.14 for apples, e.g. Fuji ones! Did J. K. Rowling write it? Yes... of course. "
            "The U.S. economy grew.\n1. Mix the flour.\n2. Bake it")
    assert sentences(text) == [
        "Mr. Smith paid $3.14 for apples, e.g. Fuji ones!", "Did J. K. Rowling write it?", "Yes...",
        "of course.", "The U.S. economy grew.", "1. Mix the flour.", "2. Bake it",
    ]


def test_sentences_after_etc_end_only_before_a_capital_and_closing_quotes_stay_attached():
    assert count_sentences("Bring pens, paper, etc. to class.") == 1
    assert sentences("Bring pens, paper, etc. Then sit down.") == ["Bring pens, paper, etc.", "Then sit down."]
    assert sentences('He said "Stop." Then he left.') == ['He said "Stop."', "Then he left."]
    assert sentences("Ends with **bold.** Next one") == ["Ends with **bold.**", "Next one"]
    assert count_sentences("  ... !!! ") == 0 and count_sentences("") == 0


def test_paragraphs_split_on_blank_lines_or_a_separator():
    text = "First paragraph.\n\n  \n\nSecond\nstill second.\n\nThird."
    assert paragraphs(text) == ["First paragraph.", "Second\nstill second.", "Third."]
    assert paragraphs("One.\n* * *\nTwo.\n* * *\n", separator="* * *") == ["One.", "Two."]
    assert count_paragraphs("A\n***\nB\n***\nC", separator="***") == 3
    assert count_paragraphs("\n\n") == 0
    with pytest.raises(ValueError, match="separator"):
        paragraphs("a", separator="")


def test_case_ratios():
    assert lowercase_ratio("abC!") == pytest.approx(2 / 3)
    assert uppercase_ratio("abC!") == pytest.approx(1 / 3)
    assert lowercase_ratio("123") == 1.0 and uppercase_ratio("123") == 0.0


# ----------------------------------------------------------------------------------------------------------
# every IFEval instruction: one response that passes, one that fails


def test_every_ifeval_id_is_registered():
    assert set(IFEVAL_CHECKS) == IFEVAL_IDS
    assert IFEVAL_IDS <= set(INSTRUCTION_CHECKS)


def test_keywords_existence():
    kwargs = {"keywords": ["compensated", "immigrants"]}
    assert check("keywords:existence", "Immigrants were COMPENSATED fairly.", **kwargs)
    assert not check("keywords:existence", "Immigrants were paid fairly.", **kwargs)


def test_keywords_frequency_boundaries():
    response = "He batted well. Then he batted again. Batted!"
    assert check("keywords:frequency", response, keyword="batted", frequency=3, relation="at least")
    assert not check("keywords:frequency", response, keyword="batted", frequency=4, relation="at least")
    assert check("keywords:frequency", response, keyword="batted", frequency=4, relation="less than")
    assert not check("keywords:frequency", response, keyword="batted", frequency=3, relation="less than")


def test_keywords_forbidden_words_match_whole_words_only():
    kwargs = {"forbidden_words": ["coop", "killings"]}
    assert check("keywords:forbidden_words", "The cooperative thrived; no one was killed.", **kwargs)
    assert not check("keywords:forbidden_words", "The Coop thrived.", **kwargs)


def test_keywords_letter_frequency():
    response = "Hello, lovely world"  # five l's
    assert check("keywords:letter_frequency", response, letter="l", let_frequency=6, let_relation="less than")
    assert not check("keywords:letter_frequency", response, letter="L", let_frequency=5, let_relation="less than")
    assert check("keywords:letter_frequency", response, letter="l", let_frequency=5, let_relation="at least")
    with pytest.raises(ValueError, match="letter"):
        check("keywords:letter_frequency", response, letter="ll", let_frequency=5, let_relation="at least")


def test_language_response_language():
    hindi = "भारत एक विशाल देश है। यहाँ अनेक भाषाएँ बोली जाती हैं और लोग मिलजुल कर रहते हैं।"
    english = "India is a vast country where many languages are spoken and people live together."
    assert check("language:response_language", hindi, language="hi")
    assert not check("language:response_language", english, language="hi")
    assert check("language:response_language", english, language="en")


def test_length_number_sentences_boundaries():
    response = "I like tea. Dr. Who likes coffee. We all like water!"  # three sentences
    assert check("length_constraints:number_sentences", response, num_sentences=4, relation="less than")
    assert not check("length_constraints:number_sentences", response, num_sentences=3, relation="less than")
    assert check("length_constraints:number_sentences", response, num_sentences=3, relation="at least")
    assert not check("length_constraints:number_sentences", response, num_sentences=4, relation="at least")


def test_length_number_words_boundaries():
    response = "one two three four five"
    assert check("length_constraints:number_words", response, num_words=5, relation="at least")
    assert not check("length_constraints:number_words", response, num_words=6, relation="at least")
    assert check("length_constraints:number_words", response, num_words=6, relation="less than")
    assert not check("length_constraints:number_words", response, num_words=5, relation="less than")


def test_length_number_paragraphs_with_markdown_dividers():
    response = "First paragraph.\n\n***\n\nSecond paragraph.\n***\nThird paragraph."
    assert check("length_constraints:number_paragraphs", response, num_paragraphs=3)
    assert not check("length_constraints:number_paragraphs", response, num_paragraphs=4)
    assert check("length_constraints:number_paragraphs", "***\n" + response + "\n***", num_paragraphs=3)
    assert not check("length_constraints:number_paragraphs", "One.\n***\n***\nTwo.", num_paragraphs=2)
    assert not check("length_constraints:number_paragraphs", "One.\n\nTwo.", num_paragraphs=2)  # blank lines only


def test_length_nth_paragraph_first_word():
    kwargs = {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "Jeanne"}
    passing = "The story begins in Paris.\n\n**Jeanne**, the baker, opened her shop early."
    assert check("length_constraints:nth_paragraph_first_word", passing, **kwargs)
    assert check("length_constraints:nth_paragraph_first_word", passing.replace("**Jeanne**", '"jeanne'), **kwargs)
    assert not check("length_constraints:nth_paragraph_first_word", passing.replace("**Jeanne**", "Marie"), **kwargs)
    three = passing + "\n\nThe end."
    assert not check("length_constraints:nth_paragraph_first_word", three, **kwargs)
    assert not check("length_constraints:nth_paragraph_first_word", passing, num_paragraphs=2, nth_paragraph=3,
                     first_word="jeanne")


def test_detectable_content_number_placeholders():
    response = "Name: [name]\nAddress: [address]\nPhone: []"
    assert check("detectable_content:number_placeholders", response, num_placeholders=2)
    assert not check("detectable_content:number_placeholders", response, num_placeholders=3)


def test_detectable_content_postscript_markers():
    letter = "Dear Sam,\nSee you soon.\n\nP.S. Bring the map."
    assert check("detectable_content:postscript", letter, postscript_marker="P.S.")
    assert not check("detectable_content:postscript", letter, postscript_marker="P.P.S")
    assert check("detectable_content:postscript", "Bye.\n\np. p. s: one more thing", postscript_marker="P.P.S")
    assert not check("detectable_content:postscript", "Bye.\n\nPS: forgot this", postscript_marker="P.S.")


def test_detectable_format_number_bullet_lists():
    response = "Reasons:\n* It is cheap.\n* It is fast.\n  - It is nested\n**Not a bullet**\n*italic aside*\n---"
    assert check("detectable_format:number_bullet_lists", response, num_bullets=3)
    assert not check("detectable_format:number_bullet_lists", response, num_bullets=4)
    assert not check("detectable_format:number_bullet_lists", response, num_bullets=2)


def test_detectable_format_constrained_response():
    assert check("detectable_format:constrained_response", "Considering everything, My answer is maybe.")
    assert not check("detectable_format:constrained_response", "My answer is: probably yes.")


def test_detectable_format_number_highlighted_sections():
    response = "*highlighted section part 1* and **highlighted section part 2**, but not ** ** nor *\nbroken*"
    assert check("detectable_format:number_highlighted_sections", response, num_highlights=2)
    assert not check("detectable_format:number_highlighted_sections", response, num_highlights=3)


def test_detectable_format_multiple_sections():
    response = "SECTION 1\nIntro text.\nSECTION 2\nMore text."
    assert check("detectable_format:multiple_sections", response, section_spliter="SECTION", num_sections=2)
    assert not check("detectable_format:multiple_sections", response, section_spliter="SECTION", num_sections=3)
    assert not check("detectable_format:multiple_sections", response, section_spliter="Section", num_sections=1)


def test_detectable_format_json_format_in_fences():
    payload = {"name": "Ada", "languages": ["en", "fr"]}
    assert check("detectable_format:json_format", json.dumps(payload))
    assert check("detectable_format:json_format", "```json\n" + json.dumps(payload, indent=2) + "\n```")
    assert check("detectable_format:json_format", "```JSON\n{}\n```")
    assert not check("detectable_format:json_format", "Here it is:\n```json\n{\"a\": 1}\n```")
    assert not check("detectable_format:json_format", "{'a': 1}")


def test_detectable_format_title():
    assert check("detectable_format:title", "<<poem of joy>>\nRoses are red.")
    assert not check("detectable_format:title", "<<   >>\nRoses are red.")
    assert not check("detectable_format:title", "# Poem of joy\nRoses are red.")


def test_combination_two_responses():
    assert check("combination:two_responses", "Paris is lovely.\n******\nRome is lovely.")
    assert not check("combination:two_responses", "Same answer.\n******\nSame answer.")
    assert not check("combination:two_responses", "A.\n******\n******\nB.")
    assert not check("combination:two_responses", "A.\n******\nB.\n******\nC.")


def test_combination_repeat_prompt():
    prompt = "Write a limerick about a cat. First repeat the request word for word without change."
    answer = "  " + prompt.upper() + "\nThere once was a cat..."
    assert check("combination:repeat_prompt", answer, prompt_to_repeat=prompt)
    assert not check("combination:repeat_prompt", "Sure! " + prompt, prompt_to_repeat=prompt)


def test_startend_end_checker():
    phrase = "Is there anything else I can help with?"
    assert check("startend:end_checker", f'"Here is the plan. {phrase.lower()}"  \n', end_phrase=phrase)
    assert not check("startend:end_checker", f"Here is the plan. {phrase} Bye.", end_phrase=phrase)


def test_startend_quotation():
    assert check("startend:quotation", '  "The whole answer is quoted."\n')
    assert not check("startend:quotation", 'The answer is "partly" quoted.')
    assert not check("startend:quotation", '"')


def test_change_case_capital_word_frequency():
    response = "The NASA and ESA teams met the WELL-KNOWN U.S. panel."  # NASA, ESA, WELL-KNOWN, U.S
    kwargs = {"capital_frequency": 4}
    assert check("change_case:capital_word_frequency", response, capital_relation="at least", **kwargs)
    assert not check("change_case:capital_word_frequency", response, capital_relation="less than", **kwargs)
    assert check("change_case:capital_word_frequency", response, capital_frequency=5, capital_relation="less than")


def test_change_case_english_capital_and_lowercase():
    upper = "THIS RESPONSE IS WRITTEN ENTIRELY IN CAPITAL LETTERS ABOUT THE WEATHER TODAY."
    assert check("change_case:english_capital", upper)
    assert not check("change_case:english_capital", upper[:-1] + "e.")
    german = "DIESE ANTWORT IST GANZ AUF DEUTSCH UND IN GROSSBUCHSTABEN GESCHRIEBEN."
    assert not check("change_case:english_capital", german)
    assert check("change_case:english_lowercase", upper.lower())
    assert not check("change_case:english_lowercase", "this is lowercase except for London.")


def test_punctuation_no_comma():
    assert check("punctuation:no_comma", "No commas here. None at all.")
    assert not check("punctuation:no_comma", "Well, one comma.")


def test_relations_and_counts_are_validated():
    assert check("length_constraints:number_words", "a b c", num_words=3.0, relation="at_least")
    with pytest.raises(ValueError, match="relation"):
        check("length_constraints:number_words", "a b c", num_words=3, relation="more than")
    with pytest.raises(ValueError, match="num_words"):
        check("length_constraints:number_words", "a b c", num_words=2.5, relation="at least")
    with pytest.raises(TypeError):
        check("punctuation:no_comma", "text", relation="at least")


# ----------------------------------------------------------------------------------------------------------
# the scorer


RESPONSE = "<think>Plan: no commas, two highlights.</think>*First point* and *second point* here."
GROUP = {
    "instruction_id": ["punctuation:no_comma", "detectable_format:number_highlighted_sections"],
    "kwargs": [None, {"num_highlights": 2}],
}


@pytest.mark.parametrize("ground_truth", [
    [GROUP],
    GROUP,
    json.dumps([GROUP]),
    str([GROUP]),  # Python literal: single quotes, None
    np.array([GROUP], dtype=object),
], ids=["list", "single-group", "json", "python-literal", "numpy"])
def test_scorer_accepts_ifbench_form(ground_truth):
    for data_source in ("ood__ifeval", "ood__ifbench"):
        result = compute_score(data_source, RESPONSE, ground_truth, None)
        assert result == {"score": 1.0, "acc": 1.0, "partial": 1.0, "passed": [True, True]}


def test_scorer_accepts_ifeval_parquet_form_with_numpy_values():
    # As pandas reads Reasoning360's ood__ifeval parquet: a numpy array of kwargs dicts holding every
    # argument (unused ones None), list arguments as numpy arrays, counts as floats.
    def row(**used):
        base = dict.fromkeys(["num_words", "relation", "keywords", "num_highlights", "forbidden_words"])
        return {**base, **used}

    ground_truth = np.array([
        row(keywords=np.array(["point", "second"], dtype=object)),
        row(num_highlights=np.float64(2.0)),
        row(num_words=8.0, relation="less than"),
        row(forbidden_words=np.array(["third"])),
    ], dtype=object)
    extra_info = {"instruction_id_list": np.array([
        "keywords:existence", "detectable_format:number_highlighted_sections", "length_constraints:number_words",
        "keywords:forbidden_words",
    ], dtype=object), "prompt": "Write two highlighted points."}
    result = compute_score("ood__ifeval", RESPONSE, ground_truth, extra_info)
    assert result["score"] == 1.0 and result["passed"] == [True, True, True, True]
    assert parse_instructions(ground_truth, extra_info)[1] == ("detectable_format:number_highlighted_sections",
                                                               {"num_highlights": 2})


def test_scorer_strict_score_and_partial_fraction():
    group = {"instruction_id": [*GROUP["instruction_id"], "startend:quotation"],
             "kwargs": [None, {"num_highlights": 2}, {}]}
    result = compute_score("ood__ifbench", RESPONSE, [group], None)
    assert result["score"] == 0.0 and result["acc"] == 0.0
    assert result["passed"] == [True, True, False]
    assert result["partial"] == pytest.approx(2 / 3)


def test_scorer_checks_only_text_after_think_and_fails_empty_answers():
    ground_truth = [{"instruction_id": ["punctuation:no_comma"], "kwargs": [{}]}]
    assert compute_score("ood__ifeval", "<think>a, b, c</think>No commas.", ground_truth)["score"] == 1.0
    assert compute_score("ood__ifeval", "Commas, here.", ground_truth)["score"] == 0.0
    assert compute_score("ood__ifeval", "<think>thinking only</think>  \n", ground_truth)["passed"] == [False]


def test_scorer_rejects_malformed_ground_truth():
    with pytest.raises(ValueError, match="unknown instruction id 'keywords:rhymes'.*punctuation:no_comma"):
        compute_score("ood__ifeval", "text", [{"instruction_id": ["keywords:rhymes"], "kwargs": [{}]}])
    with pytest.raises(ValueError, match="2 instruction ids but 1 kwargs"):
        compute_score("ood__ifbench", "text", [{"instruction_id": ["punctuation:no_comma"] * 2, "kwargs": [{}]}])
    with pytest.raises(ValueError, match="instruction_id_list"):
        compute_score("ood__ifeval", "text", [{"num_words": 3}], None)
    with pytest.raises(ValueError, match="num_words"):
        compute_score("ood__ifeval", "text", [{"instruction_id": ["length_constraints:number_words"],
                                               "kwargs": [{"relation": "at least"}]}])
    with pytest.raises(ValueError, match="neither JSON nor a Python literal"):
        compute_score("ood__ifbench", "text", "[{'instruction_id': [", None)
    with pytest.raises(ValueError, match="no instructions"):
        compute_score("ood__ifbench", "text", "[]", None)
