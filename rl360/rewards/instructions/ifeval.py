"""The 25 verifiable instructions of Google's IFEval (Zhou et al. 2023, "Instruction-Following Evaluation
for Large Language Models"), as plain checks `check(response, **kwargs) -> bool` collected in
`IFEVAL_CHECKS` by instruction id.

Every check takes exactly the keyword arguments IFEval's data uses for its instruction (the `kwargs` dict
of one instruction, None values already dropped); a missing or malformed argument raises ValueError
naming it, an unexpected one raises TypeError. Counts may be given as ints or as floats holding whole
numbers (3.0); `relation`, `let_relation` and `capital_relation` are "less than" (count < N) or "at least"
(count >= N). Words, sentences and paragraphs are those of `rl360.rewards.instructions.text`.

Behaviour follows IFEval's reference checker (the one Reasoning360 runs), with these deliberate
differences, each a closer reading of what the instruction asks:
- keywords and markers are matched literally (IFEval compiles some of them as regular expressions);
- a bullet is a line starting with "* " or "- " (a marker followed by whitespace), so "*italic*" lines
  and "---" rules are not bullets (IFEval counts both);
- a placeholder is square brackets holding some non-blank text on one line ("[]" is not one);
- `nth_paragraph_first_word` counts only non-empty paragraphs (IFEval indexes empty ones too) and takes
  the paragraph's first word after any leading quotes or markdown marks ("**Summer** ..." starts with
  "summer", where IFEval reads "**summer**");
- a ```json fence is recognised in any letter case.

Language detection (`language:response_language`, `change_case:english_capital|english_lowercase`)
uses the `langdetect` package, the detector IFEval itself uses, imported on first use and seeded so
that its answer is repeatable. As in IFEval, text in which langdetect finds no features to judge
(digits or punctuation only) passes the language part of the check.
"""

from __future__ import annotations

import json
import numbers
import operator
import re
from collections.abc import Callable, Iterable
from typing import Any

from rl360.rewards.instructions.text import count_sentences, count_words, paragraphs

RELATIONS = ("less than", "at least")
CONSTRAINED_RESPONSES = ("My answer is yes.", "My answer is no.", "My answer is maybe.")
TWO_RESPONSES_SEPARATOR = "******"
PARAGRAPH_DIVIDER = "***"

_BULLET_LINE = re.compile(r"^[ \t]*[*-][ \t]+\S", flags=re.MULTILINE)
_PLACEHOLDER = re.compile(r"\[[^\[\]\n]*\S[^\[\]\n]*\]")
_HIGHLIGHT = re.compile(r"\*\*([^\n*]+)\*\*|\*([^\n*]+)\*")
_TITLE = re.compile(r"<<([^\n]+?)>>")
_CAPITAL_TOKEN = re.compile(r"[^\W_]+(?:['’.-][^\W_]+)*")  # "WELL-KNOWN", "DON'T", "U.S" are one token each
_FIRST_WORD = re.compile(r"[^\W_]+(?:-[^\W_]+)*")
_JSON_FENCE_OPEN = re.compile(r"^```(?:json)?", flags=re.IGNORECASE)


# ----------------------------------------------------------------------------------------------------------
# Argument helpers


def _count_arg(name: str, value: Any) -> int:
    """`value` as a non-negative int: ints and whole-number floats (numpy's too) are accepted."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):  # 3.0, numpy.float32(3)
        if float(value).is_integer():
            value = int(value)
        else:
            raise ValueError(f"{name} must be a whole number, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be a whole number, got {value!r}") from None
    if number < 0:
        raise ValueError(f"{name} must not be negative, got {number}")
    return number


def _text_arg(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    return value.strip()


def _texts_arg(name: str, value: Any) -> list[str]:
    """A list of non-empty strings; a single string counts as a list of one."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, Iterable):
        raise ValueError(f"{name} must be a list of strings, got {value!r}")
    items = list(items)
    if not items:
        raise ValueError(f"{name} must not be empty")
    return [_text_arg(f"{name}[{index}]", item) for index, item in enumerate(items)]


def _compare(count: int, relation: Any, threshold: Any, *, relation_name: str, threshold_name: str) -> bool:
    """`count < threshold` for "less than", `count >= threshold` for "at least"."""
    limit = _count_arg(threshold_name, threshold)
    normalised = relation.strip().lower().replace("_", " ") if isinstance(relation, str) else relation
    if normalised == "less than":
        return count < limit
    if normalised == "at least":
        return count >= limit
    raise ValueError(f"{relation_name} must be one of {RELATIONS}, got {relation!r}")


def _split_keeping_empty(text: str, separator: str) -> list[str] | None:
    """The stripped pieces between `separator`s, empty ones at either end dropped; None when an empty piece
    lies between two separators (two separators in a row)."""
    pieces = [piece.strip() for piece in text.split(separator)]
    while pieces and not pieces[0]:
        pieces.pop(0)
    while pieces and not pieces[-1]:
        pieces.pop()
    return None if any(not piece for piece in pieces) else pieces


def _detect_language(text: str) -> str | None:
    """langdetect's ISO 639-1 code for `text` ("zh-cn"/"zh-tw" for Chinese), or None when it finds nothing
    to judge by."""
    from langdetect import DetectorFactory, LangDetectException, detect

    DetectorFactory.seed = 0  # langdetect samples at random; a fixed seed makes the answer repeatable
    try:
        return detect(text)
    except LangDetectException:
        return None


# ----------------------------------------------------------------------------------------------------------
# keywords:


def keyword_existence(response: str, *, keywords: Any) -> bool:
    """`keywords:existence`: every keyword occurs in the response (case-insensitive, anywhere, as in IFEval:
    "art" is found in "start")."""
    lowered = response.lower()
    return all(keyword.lower() in lowered for keyword in _texts_arg("keywords", keywords))


def keyword_frequency(response: str, *, keyword: Any, frequency: Any, relation: Any) -> bool:
    """`keywords:frequency`: the keyword occurs (case-insensitive, non-overlapping, anywhere) less than /
    at least `frequency` times."""
    occurrences = response.lower().count(_text_arg("keyword", keyword).lower())
    return _compare(occurrences, relation, frequency, relation_name="relation", threshold_name="frequency")


def forbidden_words(response: str, *, forbidden_words: Any) -> bool:
    """`keywords:forbidden_words`: none of the words occurs as a whole word (case-insensitive)."""
    for word in _texts_arg("forbidden_words", forbidden_words):
        if re.search(rf"\b{re.escape(word)}\b", response, flags=re.IGNORECASE):
            return False
    return True


def letter_frequency(response: str, *, letter: Any, let_frequency: Any, let_relation: Any) -> bool:
    """`keywords:letter_frequency`: the letter (either case) occurs less than / at least `let_frequency` times."""
    wanted = _text_arg("letter", letter).lower()
    if len(wanted) != 1 or not wanted.isalpha():
        raise ValueError(f"letter must be a single letter, got {letter!r}")
    return _compare(response.lower().count(wanted), let_relation, let_frequency,
                    relation_name="let_relation", threshold_name="let_frequency")


# ----------------------------------------------------------------------------------------------------------
# language: and change_case:


def response_language(response: str, *, language: Any) -> bool:
    """`language:response_language`: langdetect names `language` (ISO 639-1, e.g. "hi", "sw") for the
    whole response; a response with nothing to detect passes, as in IFEval."""
    code = _text_arg("language", language).lower()
    detected = _detect_language(response)
    return detected is None or detected == code


def english_capital(response: str) -> bool:
    """`change_case:english_capital`: the response is in English and has no lowercase letter (and at least
    one uppercase one: `str.isupper`)."""
    if not response.isupper():
        return False
    detected = _detect_language(response)
    return detected is None or detected == "en"


def english_lowercase(response: str) -> bool:
    """`change_case:english_lowercase`: the response is in English and has no uppercase letter (and at
    least one lowercase one: `str.islower`)."""
    if not response.islower():
        return False
    detected = _detect_language(response)
    return detected is None or detected == "en"


def capital_word_frequency(response: str, *, capital_frequency: Any, capital_relation: Any) -> bool:
    """`change_case:capital_word_frequency`: the number of all-capital words is less than / at least
    `capital_frequency`. A word here is letters and digits joined by hyphens, apostrophes or dots
    ("WELL-KNOWN", "DON'T" and "U.S" are one word each); it is all-capital when it has an uppercase letter
    and no lowercase one ("I" and "A" count, "3" does not)."""
    capitals = sum(1 for token in _CAPITAL_TOKEN.findall(response) if token.isupper())
    return _compare(capitals, capital_relation, capital_frequency,
                    relation_name="capital_relation", threshold_name="capital_frequency")


# ----------------------------------------------------------------------------------------------------------
# length_constraints:


def number_sentences(response: str, *, num_sentences: Any, relation: Any) -> bool:
    """`length_constraints:number_sentences`: less than / at least `num_sentences` sentences."""
    return _compare(count_sentences(response), relation, num_sentences,
                    relation_name="relation", threshold_name="num_sentences")


def number_words(response: str, *, num_words: Any, relation: Any) -> bool:
    """`length_constraints:number_words`: less than / at least `num_words` words."""
    return _compare(count_words(response), relation, num_words, relation_name="relation", threshold_name="num_words")


def number_paragraphs(response: str, *, num_paragraphs: Any) -> bool:
    """`length_constraints:number_paragraphs`: exactly `num_paragraphs` paragraphs separated by the markdown
    divider `***`. A divider at the very start or end is ignored; two dividers with nothing between them
    fail."""
    wanted = _count_arg("num_paragraphs", num_paragraphs)
    pieces = _split_keeping_empty(response, PARAGRAPH_DIVIDER)
    return pieces is not None and len(pieces) == wanted


def nth_paragraph_first_word(response: str, *, num_paragraphs: Any, nth_paragraph: Any, first_word: Any) -> bool:
    """`length_constraints:nth_paragraph_first_word`: exactly `num_paragraphs` paragraphs separated by blank
    lines, and the `nth_paragraph`-th (from 1) starts with `first_word` (case-insensitive; leading quotes
    and markdown marks are skipped, and the word ends at the first punctuation other than a hyphen)."""
    wanted = _count_arg("num_paragraphs", num_paragraphs)
    nth = _count_arg("nth_paragraph", nth_paragraph)
    if nth < 1:
        raise ValueError(f"nth_paragraph counts from 1, got {nth_paragraph!r}")
    expected = _text_arg("first_word", first_word).lower()
    found = paragraphs(response)
    if len(found) != wanted or nth > len(found):
        return False
    first = _FIRST_WORD.search(found[nth - 1])
    return first is not None and first.group(0).lower() == expected


# ----------------------------------------------------------------------------------------------------------
# detectable_content:


def number_placeholders(response: str, *, num_placeholders: Any) -> bool:
    """`detectable_content:number_placeholders`: at least `num_placeholders` placeholders in square
    brackets, such as [address]."""
    return len(_PLACEHOLDER.findall(response)) >= _count_arg("num_placeholders", num_placeholders)


def postscript(response: str, *, postscript_marker: Any) -> bool:
    """`detectable_content:postscript`: the response holds a postscript starting with the marker
    (case-insensitive, as in IFEval anywhere in the text). For "P.S." and "P.P.S" a single space may
    follow each dot ("P. S.", "P. P. S")."""
    marker = _text_arg("postscript_marker", postscript_marker)
    if marker == "P.P.S":
        pattern = r"p\.\s?p\.\s?s"
    elif marker == "P.S.":
        pattern = r"p\.\s?s\."
    else:
        pattern = re.escape(marker.lower())
    return re.search(pattern, response.lower()) is not None


# ----------------------------------------------------------------------------------------------------------
# detectable_format:


def number_bullet_lists(response: str, *, num_bullets: Any) -> bool:
    """`detectable_format:number_bullet_lists`: exactly `num_bullets` markdown bullet points, lines that
    start (after any indentation) with "*" or "-" and whitespace."""
    return len(_BULLET_LINE.findall(response)) == _count_arg("num_bullets", num_bullets)


def constrained_response(response: str) -> bool:
    """`detectable_format:constrained_response`: the response contains "My answer is yes.", "My answer is
    no." or "My answer is maybe." (exact case, as in IFEval)."""
    return any(option in response for option in CONSTRAINED_RESPONSES)


def number_highlighted_sections(response: str, *, num_highlights: Any) -> bool:
    """`detectable_format:number_highlighted_sections`: at least `num_highlights` sections highlighted with
    markdown, *like this* or **like this**, on one line and not blank."""
    spans = (single or double for double, single in _HIGHLIGHT.findall(response))
    return sum(1 for span in spans if span.strip()) >= _count_arg("num_highlights", num_highlights)


def multiple_sections(response: str, *, section_spliter: Any, num_sections: Any) -> bool:
    """`detectable_format:multiple_sections`: at least `num_sections` section marks, the splitter followed
    by a number ("SECTION 1", "Section 2"); the splitter is matched case-sensitively, as in IFEval."""
    splitter = _text_arg("section_spliter", section_spliter)
    marks = re.findall(re.escape(splitter) + r"\s*\d+", response)
    return len(marks) >= _count_arg("num_sections", num_sections)


def json_format(response: str) -> bool:
    """`detectable_format:json_format`: the whole response is one JSON value, optionally fenced in ```
    or ```json (any case)."""
    body = _JSON_FENCE_OPEN.sub("", response.strip(), count=1)
    body = body.removesuffix("```").strip()
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


def title(response: str) -> bool:
    """`detectable_format:title`: a title wrapped in double angular brackets, such as <<poem of joy>>."""
    return any(found.strip() for found in _TITLE.findall(response))


# ----------------------------------------------------------------------------------------------------------
# combination:, startend:, punctuation:


def two_responses(response: str) -> bool:
    """`combination:two_responses`: two different, non-empty responses separated by "******" (and nothing
    else: a separator at the very start or end is ignored, two in a row fail)."""
    pieces = _split_keeping_empty(response, TWO_RESPONSES_SEPARATOR)
    return pieces is not None and len(pieces) == 2 and pieces[0] != pieces[1]


def repeat_prompt(response: str, *, prompt_to_repeat: Any) -> bool:
    """`combination:repeat_prompt`: the response begins with the request, word for word (case-insensitive,
    surrounding whitespace ignored)."""
    return response.strip().lower().startswith(_text_arg("prompt_to_repeat", prompt_to_repeat).lower())


def end_checker(response: str, *, end_phrase: Any) -> bool:
    """`startend:end_checker`: the response ends with the exact phrase (case-insensitive); trailing
    whitespace and double quotes around the response are ignored, nothing may follow the phrase."""
    return response.strip().strip('"').strip().lower().endswith(_text_arg("end_phrase", end_phrase).lower())


def quotation(response: str) -> bool:
    """`startend:quotation`: the whole response (surrounding whitespace aside) is wrapped in double quotes."""
    stripped = response.strip()
    return len(stripped) > 1 and stripped[0] == '"' and stripped[-1] == '"'


def no_comma(response: str) -> bool:
    """`punctuation:no_comma`: the response has no comma."""
    return "," not in response


IFEVAL_CHECKS: dict[str, Callable[..., bool]] = {
    "keywords:existence": keyword_existence,
    "keywords:frequency": keyword_frequency,
    "keywords:forbidden_words": forbidden_words,
    "keywords:letter_frequency": letter_frequency,
    "language:response_language": response_language,
    "length_constraints:number_sentences": number_sentences,
    "length_constraints:number_paragraphs": number_paragraphs,
    "length_constraints:number_words": number_words,
    "length_constraints:nth_paragraph_first_word": nth_paragraph_first_word,
    "detectable_content:number_placeholders": number_placeholders,
    "detectable_content:postscript": postscript,
    "detectable_format:number_bullet_lists": number_bullet_lists,
    "detectable_format:constrained_response": constrained_response,
    "detectable_format:number_highlighted_sections": number_highlighted_sections,
    "detectable_format:multiple_sections": multiple_sections,
    "detectable_format:json_format": json_format,
    "detectable_format:title": title,
    "combination:two_responses": two_responses,
    "combination:repeat_prompt": repeat_prompt,
    "startend:end_checker": end_checker,
    "startend:quotation": quotation,
    "change_case:capital_word_frequency": capital_word_frequency,
    "change_case:english_capital": english_capital,
    "change_case:english_lowercase": english_lowercase,
    "punctuation:no_comma": no_comma,
}
