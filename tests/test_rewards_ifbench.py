"""IFBench-only instruction checks (`rl360.rewards.instructions.ifbench`): one pass and one fail per id, the
count boundaries, the original's quirks that decide realistic responses, kwargs handling, and the nltk
stand-ins (expected tokens and sentences are what nltk 3.10 and IFEval's splitter give)."""

from __future__ import annotations

import numpy as np
import pytest

from rl360.rewards.instructions.ifbench import (
    IFBENCH_CHECKS,
    _split_sentences_like_ifeval,
    _treebank_tokens,
    _word_tokens,
)
from rl360.rewards.instructions.ifeval import IFEVAL_CHECKS
from rl360.rewards.instructions.score import instruction_reward

IFBENCH_IDS = {
    "copy:repeat_phrase", "copy:copy", "new:copy_span_idx", "detectable_format:sentence_hyphens",
    "keywords:no_adjacent_consecutive", "detectable_format:square_brackets", "keywords:word_once",
    "keywords:word_count_different_numbers", "keywords:exclude_word_harder", "paragraphs:paragraphs",
    "paragraphs:paragraphs2", "first_word:first_word_sent", "first_word:first_word_answer",
    "last_word:last_word_sent", "last_word:last_word_answer", "detectable_format:bigram_wrapping",
    "copy:copying_simple", "copy:copying_multiple", "punctuation:punctuation_dot",
    "punctuation:punctuation_exclamation", "count:lowercase_counting", "letters:letter_counting",
    "letters:letter_counting2", "count:counting_composition", "count:count_unique",
    "count:count_increment_word", "keywords:palindrome", "keywords:keyword_specific_position",
    "keywords:start_end",
}

PHRASE = "The early bird catches the worm"
PROMPT = "Write a haiku about autumn leaves."
SPAN_PROMPT = "The quick brown fox jumps over the lazy dog."
COMPOSITION = ("Cats chase mice. Dogs chase cats.\n***\nBirds eat seeds. Fish swim fast.\n***\n"
               "Sun warms earth. Rain cools air.")

# (instruction id, kwargs, response, expected): at least one True and one False per id.
CASES = [
    # copy:repeat_phrase: exactly small_n copies, each one word different, the last one changed
    ("copy:repeat_phrase", {"phrase": PHRASE, "small_n": 2},
     "The early bird gets the worm.\nThe early bird finds the worm.", True),
    ("copy:repeat_phrase", {"phrase": PHRASE, "small_n": 2},
     "The early bird gets the worm.\nThe early bird finds the worm.\nThe early bird eats the worm.", False),
    ("copy:repeat_phrase", {"phrase": PHRASE, "small_n": 2},
     "The early cat eats the worm.\nThe early bird finds the worm.", False),  # two words changed
    ("copy:repeat_phrase", {"phrase": PHRASE, "small_n": 2},
     "The early bird gets the worm.\nThe early bird catches the worm.", False),  # last copy unchanged
    ("copy:repeat_phrase", {"phrase": PHRASE, "small_n": 2},
     "The early bird catches the worm.\nThe early bird gets the worm.", True),  # unchanged but not last
    ("copy:repeat_phrase", {"phrase": PHRASE, "small_n": 1}, "The early bird finds a worm", False),  # last word
    # copy:copy and copy:copying_simple: the prompt verbatim, case-insensitive
    ("copy:copy", {"prompt_to_repeat": PROMPT}, "  write a haiku about AUTUMN leaves.\n", True),
    ("copy:copy", {"prompt_to_repeat": PROMPT}, PROMPT + "\nLeaves drift down...", False),
    ("copy:copying_simple", {"prompt_to_repeat": PROMPT}, PROMPT, True),
    ("copy:copying_simple", {"prompt_to_repeat": PROMPT}, "Write a haiku about autumn leaves", False),
    # copy:copying_multiple: N copies separated by ******
    ("copy:copying_multiple", {"prompt_to_repeat": PROMPT, "N": 3},
     f"{PROMPT}\n******\n{PROMPT}\n******\n{PROMPT}", True),
    ("copy:copying_multiple", {"prompt_to_repeat": PROMPT, "N": 3}, f"{PROMPT}\n******\n{PROMPT}", False),
    ("copy:copying_multiple", {"prompt_to_repeat": PROMPT, "N": 2}, f"{PROMPT}\n******\nAutumn leaves.", False),
    # new:copy_span_idx: prompt[n_start:n_end], the end exclusive
    ("new:copy_span_idx", {"prompt_to_repeat": SPAN_PROMPT, "n_start": 4, "n_end": 19}, "Quick brown fox", True),
    ("new:copy_span_idx", {"prompt_to_repeat": SPAN_PROMPT, "n_start": 4, "n_end": 19}, "quick brown fox j", False),
    ("new:copy_span_idx", {"prompt_to_repeat": SPAN_PROMPT, "n_start": 0, "n_end": 9}, "The quick", True),
    # detectable_format:sentence_hyphens (Reasoning360's version: no space anywhere)
    ("detectable_format:sentence_hyphens", {}, "Rain-falls.-Birds-sing.", True),
    ("detectable_format:sentence_hyphens", {}, "Rain falls.-Birds sing.", False),
    ("detectable_format:sentence_hyphens", {}, "Rain.- Birds.", False),
    ("detectable_format:sentence_hyphens", {}, "Rain.", False),
    # keywords:no_adjacent_consecutive
    ("keywords:no_adjacent_consecutive", {}, "The cat sat on a mat.", True),
    ("keywords:no_adjacent_consecutive", {}, "We saw a big dog.", False),  # a -> big
    ("keywords:no_adjacent_consecutive", {}, "Big cat", False),  # case-insensitive
    # detectable_format:square_brackets
    ("detectable_format:square_brackets", {}, "[Hello] [world!]\n[Bye.]", True),
    ("detectable_format:square_brackets", {}, "[Hello] world", False),
    # keywords:word_once: once, case-insensitive, substrings count
    ("keywords:word_once", {"keyword": "flight"}, "My Flight was delayed.", True),
    ("keywords:word_once", {"keyword": "flight"}, "Cheap flights abound.", True),
    ("keywords:word_once", {"keyword": "flight"}, "One flight, then another flight.", False),
    ("keywords:word_once", {"keyword": "flight"}, "We took the train.", False),
    # keywords:word_count_different_numbers: boundaries of both relations
    ("keywords:word_count_different_numbers", {"keyword": "river", "frequency": 3, "relation": "at least"},
     "The river, the River, the river bank.", True),
    ("keywords:word_count_different_numbers", {"keyword": "river", "frequency": 3, "relation": "at least"},
     "The river and the river bank.", False),
    ("keywords:word_count_different_numbers", {"keyword": "river", "frequency": 3, "relation": "less than"},
     "The river and the river bank.", True),
    ("keywords:word_count_different_numbers", {"keyword": "river", "frequency": 3, "relation": "less than"},
     "The river, the River, the river bank.", False),
    # keywords:exclude_word_harder: only " keyword " (case-sensitive, spaces both sides) counts
    ("keywords:exclude_word_harder", {"keyword": "happy"}, "I am happy today.", False),
    ("keywords:exclude_word_harder", {"keyword": "happy"}, "Happy days are here.", True),
    ("keywords:exclude_word_harder", {"keyword": "happy", "instruction": "Do not say happy"}, "I am happy.", True),
    # paragraphs:paragraphs: two paragraphs separated by ***
    ("paragraphs:paragraphs", {}, "First paragraph here.\n\n***\n\nSecond paragraph here.", True),
    ("paragraphs:paragraphs", {}, "***\nFirst paragraph.\n***\nSecond paragraph.", True),  # leading divider
    ("paragraphs:paragraphs", {}, "One.\n***\nTwo.\n***\nThree.", False),
    ("paragraphs:paragraphs", {}, "One.\n* * *\nTwo.", False),
    ("paragraphs:paragraphs", {}, "One.\n***\n***\nTwo.", False),  # an empty paragraph in between
    # paragraphs:paragraphs2: two paragraphs separated by one blank line
    ("paragraphs:paragraphs2", {}, "First paragraph here.\n\nSecond paragraph here.", True),
    ("paragraphs:paragraphs2", {}, "First paragraph.\nSecond line.", False),
    ("paragraphs:paragraphs2", {}, "First paragraph.\n\n\n\nSecond paragraph.", False),
    ("paragraphs:paragraphs2", {}, "One.\n\nTwo.\n\nThree.", False),
    # first_word:first_word_sent: punctuation stays on the token
    ("first_word:first_word_sent", {"first_word": "Indeed"}, "Indeed it rains. indeed the sky is grey!", True),
    ("first_word:first_word_sent", {"first_word": ["Indeed"]}, "Indeed it rains. The sky is grey.", False),
    ("first_word:first_word_sent", {"first_word": "Indeed"}, "Indeed, it rains.", False),
    ("first_word:first_word_sent", {"first_word": "Indeed"}, "Indeed it does?! Indeed.", False),  # "!" alone
    # first_word:first_word_answer
    ("first_word:first_word_answer", {"first_word": "Yes"}, "yes I think so.", True),
    ("first_word:first_word_answer", {"first_word": "Yes"}, "Yes, I think so.", False),
    ("first_word:first_word_answer", {"first_word": "Yes"}, "Well yes.", False),
    # last_word:last_word_sent: punctuation removed from the last token
    ("last_word:last_word_sent", {"last_word": "today"}, "I went out today. It rained TODAY!", True),
    ("last_word:last_word_sent", {"last_word": np.array(["today"])}, "I went out today. It rained.", False),
    # last_word:last_word_answer
    ("last_word:last_word_answer", {"last_word": "goodbye"}, "That is all, Goodbye!", True),
    ("last_word:last_word_answer", {"last_word": "goodbye"}, "Goodbye and thanks.", False),
    # detectable_format:bigram_wrapping
    ("detectable_format:bigram_wrapping", {}, "<<I am>> <<at home>> <<with my>> <<cute dog>>", True),
    ("detectable_format:bigram_wrapping", {}, "<<I am>> home", True),  # an odd last word is free
    ("detectable_format:bigram_wrapping", {}, "<<I am at>> home", False),
    # punctuation:punctuation_dot and punctuation:punctuation_exclamation
    ("punctuation:punctuation_dot", {}, "No dots here, only commas", True),
    ("punctuation:punctuation_dot", {}, "Version 3", True),
    ("punctuation:punctuation_dot", {}, "Version 3.5 is out", False),
    ("punctuation:punctuation_exclamation", {}, "Calm text.", True),
    ("punctuation:punctuation_exclamation", {}, "Wow! Great.", False),
    # count:lowercase_counting: total lowercase words <= N
    ("count:lowercase_counting", {"N": 3}, "THE cat sat on THE MAT", True),
    ("count:lowercase_counting", {"N": 3}, "THE cat sat on the MAT", False),
    ("count:lowercase_counting", {"N": 2}, "I don't", True),  # "don", "t"
    ("count:lowercase_counting", {"N": 1}, "I don't", False),
    # letters:letter_counting: ASCII letters only
    ("letters:letter_counting", {"N": 10, "relation": "at least"}, "Hello, world! 123", True),  # 10 letters
    ("letters:letter_counting", {"N": 11, "relation": "at least"}, "Hello, world! 123", False),
    ("letters:letter_counting", {"N": 10, "relation": "less than"}, "Hello, world! 123", False),
    ("letters:letter_counting", {"N": 11, "relation": "less than"}, "Héllo, world", True),  # é is no ASCII letter
    # letters:letter_counting2: one letter, case-insensitive
    ("letters:letter_counting2", {"letter": "s", "let_frequency": 3, "let_relation": "at least"}, "Sassy", True),
    ("letters:letter_counting2", {"letter": "s", "let_frequency": 4, "let_relation": "at least"}, "Sassy", False),
    ("letters:letter_counting2", {"letter": "S", "let_frequency": 3, "let_relation": "less than"}, "Sassy", False),
    # count:counting_composition: 3 x "***", n_sent sentences of n_words tokens (the "." is a token)
    ("count:counting_composition", {"n_sent": 2, "n_words": 4}, COMPOSITION, True),
    ("count:counting_composition", {"n_sent": 2, "n_words": 3}, COMPOSITION, False),
    ("count:counting_composition", {"n_sent": 2, "n_words": 4}, COMPOSITION.replace("***", "* * *"), False),
    ("count:counting_composition", {"n_sent": 2, "n_words": 4}, "***\n" + COMPOSITION, False),
    ("count:counting_composition", {"n_sent": 2, "n_words": 4}, COMPOSITION.replace("Fish swim", "Big fish swim"),
     False),
    # count:count_unique: nltk tokens, case-sensitive, punctuation included
    ("count:count_unique", {}, "Red, blue and green.", True),
    ("count:count_unique", {}, "The cat saw the dog", True),
    ("count:count_unique", {}, "the cat saw the dog", False),
    ("count:count_unique", {}, "Cats purr. Dogs bark.", False),  # "." twice
    # count:count_increment_word
    ("count:count_increment_word", {"keyword1": "moon", "keyword2": "star"},
     "The moon rose, a star shone, then another Star.", True),
    ("count:count_increment_word", {"keyword1": "moon", "keyword2": "star"},
     "The moon rose, a star shone, then the moon set.", False),
    ("count:count_increment_word", {"keyword1": "moon", "keyword2": "star"},
     "The moon rose and starlight fell on a star.", True),  # "starlight" counts
    # keywords:palindrome: any whitespace token equal to its reverse
    ("keywords:palindrome", {}, "The radar works", True),
    ("keywords:palindrome", {}, "I think so", True),  # "I"
    ("keywords:palindrome", {}, "Level design matters", False),  # case-sensitive
    # keywords:keyword_specific_position: the m-th nltk token of the n-th sentence
    ("keywords:keyword_specific_position", {"keyword": "ocean", "n": 2, "m": 3},
     "I love water. The blue ocean is vast.", True),
    ("keywords:keyword_specific_position", {"keyword": "ocean", "n": 2, "m": 3},
     "I love water. The ocean is blue.", False),
    ("keywords:keyword_specific_position", {"keyword": "ocean", "n": 1, "m": 4}, "Well, the ocean is calm.", True),
    ("keywords:keyword_specific_position", {"keyword": "ocean", "n": 1, "m": 3}, "Well, the ocean is calm.", False),
    ("keywords:keyword_specific_position", {"keyword": ["ocean"], "n": 1, "m": 3}, "The blue Ocean.", False),
    ("keywords:keyword_specific_position", {"keyword": "ocean", "n": 3, "m": 1}, "One. Two.", False),
    # keywords:start_end
    ("keywords:start_end", {}, "Hello there, my friend, hello", True),
    ("keywords:start_end", {}, "Hello there, my friend, Hello.", False),  # the "." is the last token
    ("keywords:start_end", {}, "Well-known facts remain Well", False),  # a hyphen: split on "-"
    ("keywords:start_end", {}, "Hello", False),
]


def test_registry_is_the_ids_ifbench_adds_to_ifeval():
    assert set(IFBENCH_CHECKS) == IFBENCH_IDS
    assert not set(IFBENCH_CHECKS) & set(IFEVAL_CHECKS)


def test_every_id_has_a_passing_and_a_failing_case():
    outcomes = {(instruction_id, expected) for instruction_id, _, _, expected in CASES}
    assert {(instruction_id, flag) for instruction_id in IFBENCH_IDS for flag in (True, False)} <= outcomes


@pytest.mark.parametrize(("instruction_id", "kwargs", "response", "expected"), CASES,
                         ids=[f"{case[0]}-{index}" for index, case in enumerate(CASES)])
def test_check(instruction_id, kwargs, response, expected):
    assert IFBENCH_CHECKS[instruction_id](response, **kwargs) is expected


def test_every_check_has_a_docstring():
    for instruction_id, check in IFBENCH_CHECKS.items():
        assert check.__doc__ and check.__doc__.startswith("Passes"), instruction_id


@pytest.mark.parametrize(("frequency", "at_least"),
                         [(3.0, True), (np.int64(3), True), (4.0, False), (np.int32(4), False)])
def test_integer_kwargs_accept_floats_and_numpy(frequency, at_least):
    check = IFBENCH_CHECKS["keywords:word_count_different_numbers"]
    assert check("river river river", keyword="river", frequency=frequency, relation="at least") is at_least
    assert check("river river river", keyword="river", frequency=frequency, relation="less than") is not at_least


@pytest.mark.parametrize(("instruction_id", "kwargs", "named"), [
    ("keywords:word_once", {}, "'keyword'"),
    ("keywords:word_once", {"keyword": "  "}, "'keyword'"),
    ("keywords:word_count_different_numbers", {"keyword": "a", "frequency": 2, "relation": "at most"}, "'relation'"),
    ("keywords:word_count_different_numbers", {"keyword": "a", "frequency": 2.5, "relation": "at least"},
     "'frequency'"),
    ("letters:letter_counting", {"N": True, "relation": "at least"}, "'N'"),
    ("letters:letter_counting2", {"letter": "ab", "let_frequency": 1, "let_relation": "at least"}, "'letter'"),
    ("copy:repeat_phrase", {"phrase": PHRASE}, "'small_n'"),
    ("copy:copying_multiple", {"prompt_to_repeat": PROMPT, "N": 0}, "'N'"),
    ("new:copy_span_idx", {"prompt_to_repeat": SPAN_PROMPT, "n_start": 3}, "'n_end'"),
    ("keywords:keyword_specific_position", {"keyword": "x", "n": 1, "m": -1}, "'m'"),
    ("first_word:first_word_sent", {"first_word": []}, "'first_word'"),
    ("count:counting_composition", {"n_sent": "two", "n_words": 3}, "'n_sent'"),
])
def test_malformed_kwargs_raise_naming_the_kwarg(instruction_id, kwargs, named):
    with pytest.raises(ValueError, match=named):
        IFBENCH_CHECKS[instruction_id]("Some response.", **kwargs)


def test_unknown_kwarg_is_a_type_error():
    with pytest.raises(TypeError, match="colour"):
        IFBENCH_CHECKS["keywords:palindrome"]("noon", colour="red")


@pytest.mark.parametrize(("text", "expected"), [
    ("What?! Yes.", ["What?", "!", "Yes."]),
    ("Plan A. Then plan B. Done.", ["Plan A. Then plan B. Done."]),
    ("Mr. Smith met Dr. Who at 3.5 p.m. today. He left.", ["Mr. Smith met Dr. Who at 3.5 p.m. today.", "He left."]),
    ('He said "no." Then he left!', ['He said "no".', "Then he left!"]),
    ("Visit example.com now. Bye...", ["Visit example.com now.", "Bye..."]),
    ("The U.S. He said so.", ["The U.S.", "He said so."]),
    ("1. First step.\n2. Second step.", ["1.", "First step.", "2.", "Second step."]),
    ("", []),
])
def test_sentence_splitter_matches_ifeval(text, expected):
    assert _split_sentences_like_ifeval(text) == expected


@pytest.mark.parametrize(("sentence", "expected"), [
    ("Good muffins cost $3.88 (roughly 3,36 euros)\nin New York.  Please buy me\ntwo of them.\nThanks.",
     ["Good", "muffins", "cost", "$", "3.88", "(", "roughly", "3,36", "euros", ")", "in", "New", "York.",
      "Please", "buy", "me", "two", "of", "them.", "Thanks", "."]),
    ('I don\'t like "cats", e.g. 1,000 of them... (really)!',
     ["I", "do", "n't", "like", "``", "cats", "''", ",", "e.g.", "1,000", "of", "them", "...", "(", "really", ")",
      "!"]),
    ("Well, I agree.", ["Well", ",", "I", "agree", "."]),
    ("She's here; he'd go -- they'll see.",
     ["She", "'s", "here", ";", "he", "'d", "go", "--", "they", "'ll", "see", "."]),
    ("Time is 3:45, ratio 2:1.", ["Time", "is", "3:45", ",", "ratio", "2:1", "."]),
    ('"Hello," she said.', ["``", "Hello", ",", "''", "she", "said", "."]),
    ("I cannot wait, gonna be fun.", ["I", "can", "not", "wait", ",", "gon", "na", "be", "fun", "."]),
    ("A well-known fact.", ["A", "well-known", "fact", "."]),
])
def test_treebank_tokens_match_nltk(sentence, expected):
    assert _treebank_tokens(sentence) == expected


def test_word_tokens_split_sentences_first():
    # punkt's role: each sentence's final "." becomes a token, not only the last one
    assert _word_tokens("Cats purr. Dogs bark.") == ["Cats", "purr", ".", "Dogs", "bark", "."]


def test_scored_through_the_ood_ifbench_reward():
    ground_truth = ("[{'instruction_id': ['keywords:word_once', 'punctuation:punctuation_exclamation', "
                    "'last_word:last_word_answer'], 'kwargs': [{'keyword': 'flight'}, None, {'last_word': 'home'}]}]")
    good = instruction_reward("<think>plan</think>My flight landed and I went home.", ground_truth)
    bad = instruction_reward("My flight landed! I went home.", ground_truth)
    assert good["score"] == 1.0
    assert bad["score"] == 0.0 and bad["passed"] == [True, False, True]
