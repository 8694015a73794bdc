"""The IFBench-only instruction checks (`ood__ifbench`, allenai's IF_multi_constraints data).

`IFBENCH_CHECKS` maps each instruction id that Reasoning360's IFBench registry adds to IFEval's 25 to
a function `check(response, **kwargs) -> bool`, taking the kwargs names the data uses. The checks
reproduce what Reasoning360's copy of the IFBench verifiers accepts, quirks included, because those are
the scores `ood__ifbench` results are compared with; each docstring says what passes, and where the
original behaviour is surprising it says so.

Kwargs: integers may arrive as floats (3.0) or numpy integers; `first_word`, `last_word` and the
position check's `keyword` may be lists (the first item is used, as the original does). A missing or
malformed kwarg raises ValueError naming it (the original would draw a random value instead, which
cannot score anything); an unknown one raises TypeError. Empty responses are the scorer's business
(`score.py` fails every instruction on an empty answer, as Reasoning360 does): some checks here (no
dots, ...) are vacuously true on one.

Two text utilities stand in for nltk, whose data files cannot be downloaded here:

- `_split_sentences_like_ifeval` is the regex sentence splitter IFEval ships (`split_into_sentences`),
  rewritten rule for rule: the sentence-level checks index and count its pieces, so its quirks matter
  ("?!" gives two pieces, a one-letter word such as "A." or "I." never ends a sentence, `."` becomes `".`).
- `_treebank_tokens` reproduces nltk's `word_tokenize` on one sentence (Penn Treebank rules: punctuation
  is a token of its own, "don't" is "do" + "n't", a sentence-final "." is split off, "1,000", "3.14",
  "e.g." and "well-known" stay whole). Where `word_tokenize` first splits text into sentences with punkt,
  `rl360.rewards.instructions.text.sentences` takes punkt's place.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable

from rl360.rewards.instructions.text import sentences as punkt_like_sentences

IFBENCH_CHECKS: dict[str, Callable[..., bool]] = {}

_RELATIONS = ("less than", "at least")


def _instruction(*instruction_ids: str) -> Callable[[Callable[..., bool]], Callable[..., bool]]:
    """Register the decorated check in `IFBENCH_CHECKS` under each of `instruction_ids`."""

    def register(check: Callable[..., bool]) -> Callable[..., bool]:
        for instruction_id in instruction_ids:
            IFBENCH_CHECKS[instruction_id] = check
        return check

    return register


# ---------------------------------------------------------------------------------------------------------
# kwargs


def _int_arg(name: str, value: object, minimum: int = 0) -> int:
    """`value` as an int >= minimum; integral floats and numpy integers are accepted."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"kwarg {name!r} must be an integer, got {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"kwarg {name!r} must be an integer, got {value!r}")
        value = int(value)
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"kwarg {name!r} must be an integer, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"kwarg {name!r} must be >= {minimum}, got {number}")
    return number


def _text_arg(name: str, value: object, first_of_list: bool = False) -> str:
    """`value` stripped, which must be a non-empty string (or, with first_of_list, a list starting with one)."""
    if first_of_list:
        if hasattr(value, "tolist"):  # a numpy array read from parquet
            value = value.tolist()
        if isinstance(value, list | tuple):
            value = value[0] if value else None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"kwarg {name!r} must be a non-empty string, got {value!r}")
    return value.strip()


def _relation_arg(name: str, value: object) -> str:
    """`value`, which must be "less than" or "at least"."""
    if not isinstance(value, str) or value.strip() not in _RELATIONS:
        raise ValueError(f"kwarg {name!r} must be one of {_RELATIONS}, got {value!r}")
    return value.strip()


def _compare(count: int, relation: str, threshold: int) -> bool:
    return count < threshold if relation == "less than" else count >= threshold


def _occurrences(keyword: str, response: str) -> int:
    """How often `keyword` occurs in `response`, case-insensitively, as a substring ("cat" counts in "cats")."""
    return len(re.findall(re.escape(keyword), response, flags=re.IGNORECASE))


# ---------------------------------------------------------------------------------------------------------
# IFEval's regex sentence splitter (`split_into_sentences`), rule for rule

_KEEP = "\x00"  # a "." that does not end a sentence
_STOP = "\x01"  # a sentence boundary
_STARTERS = (r"(Mr|Mrs|Ms|Dr|Prof|Capt|Cpt|Lt|He\s|She\s|It\s|They\s|Their\s|Our\s|We\s|But\s|However\s|"
             r"That\s|This\s|Wherever)")
_COMPANY_SUFFIX = "(Inc|Ltd|Jr|Sr|Co)"
_SENTENCE_RULES: tuple[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]], ...] = (
    (re.compile(r"(Mr|St|Mrs|Ms|Dr)\."), rf"\1{_KEEP}"),  # titles (case-sensitive, anywhere: "ST." too)
    (re.compile(r"\.(com|net|org|io|gov|edu|me)"), rf"{_KEEP}\1"),  # web addresses
    (re.compile(r"([0-9])\.([0-9])"), rf"\1{_KEEP}\2"),  # decimals
    (re.compile(r"\.{2,}"), lambda dots: _KEEP * len(dots.group(0)) + _STOP),  # an ellipsis ends a sentence
    (re.compile(r"Ph\.D\."), f"Ph{_KEEP}D{_KEEP}"),
    (re.compile(r"\s([A-Za-z])\. "), rf" \1{_KEEP} "),  # a lone letter: "Plan A. Then" does not split
    (re.compile(r"([A-Z]\.[A-Z]\.(?:[A-Z]\.)?) " + _STARTERS), rf"\1{_STOP} \2"),  # "U.S. He ..." splits
    (re.compile(r"([A-Za-z])\.([A-Za-z])\.([A-Za-z])\."), rf"\1{_KEEP}\2{_KEEP}\3{_KEEP}"),
    (re.compile(r"([A-Za-z])\.([A-Za-z])\."), rf"\1{_KEEP}\2{_KEEP}"),  # "e.g.", "U.S."
    (re.compile(" " + _COMPANY_SUFFIX + r"\. " + _STARTERS), rf" \1{_STOP} \2"),  # the "." itself is dropped
    (re.compile(" " + _COMPANY_SUFFIX + r"\."), rf" \1{_KEEP}"),
    (re.compile(r" ([A-Za-z])\."), rf" \1{_KEEP}"),
)
_QUOTE_BEFORE_END = ((".\u201d", "\u201d."), ('."', '".'), ('!"', '"!'), ('?"', '"?'))


def _split_sentences_like_ifeval(text: str) -> list[str]:
    """Sentences as IFEval's regex splitter cuts them: every unprotected ".", "?" and "!" ends one.

    Newlines are spaces; pieces are stripped and may hold no word ("What?!" gives "What?" and "!"); the
    closing quote of `."`/`!"`/`?"` is moved before the punctuation; only a trailing empty piece is dropped.
    """
    text = f" {text}  ".replace("\n", " ")
    for pattern, replacement in _SENTENCE_RULES:
        text = pattern.sub(replacement, text)
    for before, after in _QUOTE_BEFORE_END:
        text = text.replace(before, after)
    for mark in ".?!":
        text = text.replace(mark, mark + _STOP)
    pieces = [piece.strip() for piece in text.replace(_KEEP, ".").split(_STOP)]
    if pieces and not pieces[-1]:
        pieces.pop()
    return pieces


# ---------------------------------------------------------------------------------------------------------
# nltk's Treebank word tokenizer (what `nltk.word_tokenize` applies to each sentence)

# word-final contractions and quotes, split off in two passes ("don't's" gives "do", "n't", "'s")
_CONTRACTION_SUFFIXES = (re.compile(r"([^' ])('[sSmMdD]|') "), re.compile(r"([^' ])('ll|'LL|'re|'RE|'ve|'VE|n't|N'T) "))
_TREEBANK_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    # opening quotes: curly ones and backticks, a leading ", and a " or '' after a space or opening bracket
    (re.compile("([«“‘„]|`+)"), r" \1 "),
    (re.compile(r'^"'), " `` "),
    (re.compile(r"""(?<=[ (\[{<])(?:"|'')"""), " `` "),
    # an opening single quote that does not start a contraction ('hello but not 's or 'll)
    (re.compile(r"(?i)(?<!\w)'(?!(?:re|ve|ll|m|t|s|d|n)\b)(?=\w)"), "' "),
    # the sentence-final period, before any closing brackets and quotes
    (re.compile(r"""(?<=[^.])\.([\])}>"'»”’ ]*)\s*$"""), r" . \1 "),
    # commas and colons, except before a digit ("1,000", "3:45"); the character after one is not itself
    # split off, so ",," gives "," and ",b" as in nltk
    (re.compile(r"([:,])([^\d])"), r" \1 \2"),
    (re.compile(r"[:,]$"), r" \g<0> "),
    # ellipses, symbols, dashes, "?", "!" and (after a closing single quote followed by a space is split
    # off) "*", brackets and "--" are tokens of their own
    (re.compile(r"\.{2,}|[;@#$%&?!\u2012-\u2015]"), r" \g<0> "),
    (re.compile(r"(?<=[^'])' "), " ' "),
    (re.compile(r"--|[*\[\](){}<>]"), r" \g<0> "),
    # closing quotes; any " left over closes a quote
    (re.compile("([»”’])"), r" \1 "),
    (re.compile("''"), " '' "),
    (re.compile('"'), " '' "),
)
_SPLIT_WORDS = tuple(re.compile(pattern) for pattern in (
    r"(?i)\b(can)(not)\b", r"(?i)\b(d)('ye)\b", r"(?i)\b(gim)(me)\b", r"(?i)\b(gon)(na)\b",
    r"(?i)\b(got)(ta)\b", r"(?i)\b(lem)(me)\b", r"(?i)\b(more)('n)\b", r"(?i)\b(wan)(na)(?=\s)",
    r"(?i) ('t)(is)\b", r"(?i) ('t)(was)\b",
))


def _treebank_tokens(sentence: str) -> list[str]:
    """The tokens nltk's Treebank tokenizer gives one sentence (see the module docstring)."""
    text = sentence
    for pattern, replacement in _TREEBANK_RULES:
        text = pattern.sub(replacement, text)
    text = " " + re.sub(r"\s+", " ", text) + " "
    for pattern in _CONTRACTION_SUFFIXES:
        text = pattern.sub(r"\1 \2 ", text)
    for pattern in _SPLIT_WORDS:
        text = pattern.sub(r" \1 \2 ", text)
    return text.split()


def _word_tokens(text: str) -> list[str]:
    """nltk's `word_tokenize`: sentences (punkt's role played by `text.sentences`), each Treebank-tokenized."""
    return [token for sentence in punkt_like_sentences(text) for token in _treebank_tokens(sentence)]


# ---------------------------------------------------------------------------------------------------------
# copying


@_instruction("copy:repeat_phrase")
def repeat_phrase(response: str, *, phrase: str | None = None, small_n: int | None = None) -> bool:
    """Passes when the phrase is repeated exactly `small_n` times, each copy changing one word.

    A copy is a span (on one line) from the phrase's first word to its last word; there must be exactly
    `small_n` of them, each with the phrase's number of words (split on whitespace) and at most one word
    different, and the last one must differ in exactly one word (the original's rule: an unchanged copy
    passes anywhere but last).
    """
    words = _text_arg("phrase", phrase).split()
    count = _int_arg("small_n", small_n, minimum=1)
    pattern = re.escape(words[0]) + " .*? " + re.escape(words[-1])
    copies = [copy.split() for copy in re.findall(pattern, response)]
    if len(copies) != count:
        return False
    differences = [sum(a != b for a, b in zip(copy, words)) for copy in copies]
    if any(len(copy) != len(words) for copy in copies) or max(differences) > 1:
        return False
    return differences[-1] == 1


@_instruction("copy:copy", "copy:copying_simple")
def copy_prompt(response: str, *, prompt_to_repeat: str | None = None) -> bool:
    """Passes when the response is the prompt itself (case-insensitive, surrounding whitespace ignored)."""
    prompt = _text_arg("prompt_to_repeat", prompt_to_repeat)
    return response.strip().lower() == prompt.lower()


@_instruction("copy:copying_multiple")
def copy_prompt_n_times(response: str, *, prompt_to_repeat: str | None = None, N: int | None = None) -> bool:
    """Passes when the response is the prompt `N` times separated by "******" (each copy case-insensitive)."""
    prompt = _text_arg("prompt_to_repeat", prompt_to_repeat).lower()
    copies = response.split("******")
    return len(copies) == _int_arg("N", N, minimum=1) and all(copy.strip().lower() == prompt for copy in copies)


@_instruction("new:copy_span_idx")
def copy_span(response: str, *, prompt_to_repeat: str | None = None, n_start: int | None = None,
              n_end: int | None = None) -> bool:
    """Passes when the response is `prompt_to_repeat[n_start:n_end]` (case-insensitive, stripped).

    The end index is exclusive, as in the original, although the prompt says "including". (The original
    draws a random start when n_start is 0; here 0 means the first character.)
    """
    if not isinstance(prompt_to_repeat, str) or not prompt_to_repeat:
        raise ValueError(f"kwarg 'prompt_to_repeat' must be a non-empty string, got {prompt_to_repeat!r}")
    span = prompt_to_repeat[_int_arg("n_start", n_start):_int_arg("n_end", n_end)]
    return response.strip().lower() == span.strip().lower()


# ---------------------------------------------------------------------------------------------------------
# format


@_instruction("detectable_format:sentence_hyphens")
def sentences_joined_by_hyphens(response: str) -> bool:
    """Passes when the response has a hyphen and no space anywhere, nor whitespace next to a hyphen.

    Reasoning360's version of this check: every hyphen-separated piece must be free of spaces, so
    "Cats purr.-Dogs bark." fails (spaces inside the sentences) while "Cats-purr.-Dogs-bark." passes.
    """
    pieces = response.split("-")
    return len(pieces) >= 2 and all(piece == piece.strip() and " " not in piece for piece in pieces)


@_instruction("detectable_format:square_brackets")
def every_word_in_square_brackets(response: str) -> bool:
    """Passes when every whitespace-separated token starts with "[" and ends with "]" ("[Hello] [world]")."""
    return all(token.startswith("[") and token.endswith("]") for token in response.split())


@_instruction("detectable_format:bigram_wrapping")
def bigrams_wrapped(response: str) -> bool:
    """Passes when tokens 1-2, 3-4, ... are wrapped as "<<first second>>" (an odd last token is free)."""
    tokens = response.split()
    return all(tokens[i].startswith("<<") and tokens[i + 1].endswith(">>") for i in range(0, len(tokens) - 1, 2))


_DIVIDER = re.compile(r"\s?\*\*\*\s?")


def _exactly_two_paragraphs(pieces: list[str]) -> bool:
    """Two non-blank pieces; a blank piece is allowed only first or last (a leading/trailing separator)."""
    inner_blank = any(not piece.strip() for piece in pieces[1:-1])
    return not inner_blank and sum(1 for piece in pieces if piece.strip()) == 2


@_instruction("paragraphs:paragraphs")
def two_paragraphs_by_divider(response: str) -> bool:
    """Passes when "***" splits the response into exactly two non-empty paragraphs ("* * *" is no divider)."""
    return _exactly_two_paragraphs(_DIVIDER.split(response))


@_instruction("paragraphs:paragraphs2")
def two_paragraphs_by_blank_line(response: str) -> bool:
    """Passes when "\\n\\n" splits the response into exactly two non-empty paragraphs (no extra blank lines)."""
    return _exactly_two_paragraphs(response.split("\n\n"))


# ---------------------------------------------------------------------------------------------------------
# keywords


@_instruction("keywords:word_once")
def keyword_exactly_once(response: str, *, keyword: str | None = None) -> bool:
    """Passes when `keyword` occurs exactly once, case-insensitive, counting substrings ("flights" has one)."""
    return _occurrences(_text_arg("keyword", keyword), response) == 1


@_instruction("keywords:word_count_different_numbers")
def keyword_frequency(response: str, *, keyword: str | None = None, frequency: int | None = None,
                      relation: str | None = None) -> bool:
    """Passes when `keyword` (case-insensitive, substrings count) occurs "less than"/"at least" `frequency` times."""
    count = _occurrences(_text_arg("keyword", keyword), response)
    return _compare(count, _relation_arg("relation", relation), _int_arg("frequency", frequency))


@_instruction("keywords:exclude_word_harder")
def keyword_excluded(response: str, *, keyword: str | None = None, instruction: str | None = None) -> bool:
    """Passes unless `keyword` appears with a space on both sides (case-sensitive, as the original).

    "the cat sat" fails for "cat"; "Cat", "cat." and a leading "cat " do not count. `instruction` (the
    text the original drew a random keyword from when none was given) is accepted and ignored.
    """
    return f" {_text_arg('keyword', keyword)} " not in response


@_instruction("count:count_increment_word")
def keyword_once_and_twice(response: str, *, keyword1: str | None = None, keyword2: str | None = None) -> bool:
    """Passes when `keyword1` occurs exactly once and `keyword2` exactly twice (case-insensitive substrings)."""
    once = _occurrences(_text_arg("keyword1", keyword1), response)
    twice = _occurrences(_text_arg("keyword2", keyword2), response)
    return once == 1 and twice == 2


@_instruction("keywords:keyword_specific_position")
def keyword_at_position(response: str, *, keyword: str | list[str] | None = None, n: int | None = None,
                        m: int | None = None) -> bool:
    """Passes when the `m`-th token of the `n`-th sentence is exactly `keyword` (case-sensitive, 1-based).

    Sentences as IFEval's splitter cuts them, tokens as nltk's `word_tokenize` (punctuation counts: in
    "Well, I agree." the token "I" is third).
    """
    word = _text_arg("keyword", keyword, first_of_list=True)
    sentence_index, token_index = _int_arg("n", n, minimum=1) - 1, _int_arg("m", m, minimum=1) - 1
    found = _split_sentences_like_ifeval(response)
    if sentence_index >= len(found):
        return False
    tokens = _treebank_tokens(found[sentence_index])
    return token_index < len(tokens) and tokens[token_index] == word


@_instruction("keywords:palindrome")
def contains_palindrome(response: str) -> bool:
    """Passes when some whitespace-separated token reads the same reversed, exactly ("level", also "a" or "I")."""
    return any(token == token[::-1] for token in response.split())


@_instruction("keywords:no_adjacent_consecutive")
def no_adjacent_consecutive_initials(response: str) -> bool:
    """Passes when no two neighbouring tokens start with consecutive characters ("a b", "Big cat", "1 2" fail).

    Tokens are split on whitespace; their first characters are lowercased and compared by code point, so
    "cat bird" (c then b) passes and so does a token starting with punctuation unless the next one follows it.
    """
    initials = [token[0].lower() for token in response.split()]
    for first, second in zip(initials, initials[1:]):
        if len(first) != 1 or len(second) != 1 or ord(second) - ord(first) == 1:  # "İ".lower() is 2 characters
            return False
    return True


@_instruction("keywords:start_end")
def starts_and_ends_with_same_word(response: str) -> bool:
    """Passes when the first and last word are the same, case-insensitive, with nothing after the last.

    Words are nltk tokens, so a final "." is a token of its own and "Hello ... Hello." fails. Reasoning360's
    version splits on "-" instead whenever the response has a hyphen, comparing the whole text before the
    first hyphen with the whole text after the last one.
    """
    tokens = response.split("-") if "-" in response else _treebank_tokens(response)
    return len(tokens) >= 2 and tokens[0].lower() == tokens[-1].lower()


# ---------------------------------------------------------------------------------------------------------
# first and last words


@_instruction("first_word:first_word_sent")
def every_sentence_starts_with(response: str, *, first_word: str | list[str] | None = None) -> bool:
    """Passes when every sentence's first whitespace token is `first_word` (case-insensitive).

    Punctuation stays on the token ("However," is not "however"); sentences as IFEval's splitter cuts them,
    so a lone "!" after "?" (from "?!") is a sentence that fails.
    """
    expected = _text_arg("first_word", first_word, first_of_list=True).lower()
    for sentence in _split_sentences_like_ifeval(response):
        if not sentence or sentence.split()[0].lower() != expected:
            return False
    return True


@_instruction("first_word:first_word_answer")
def response_starts_with(response: str, *, first_word: str | None = None) -> bool:
    """Passes when the response's first whitespace token is `first_word` (case-insensitive; "Yes," is not "yes")."""
    tokens = response.split()
    return bool(tokens) and tokens[0].lower() == _text_arg("first_word", first_word).lower()


_NOT_WORD_OR_SPACE = re.compile(r"[^\w\s]")


@_instruction("last_word:last_word_sent")
def every_sentence_ends_with(response: str, *, last_word: str | list[str] | None = None) -> bool:
    """Passes when every sentence's last token, punctuation removed, is `last_word` (case-insensitive)."""
    expected = _text_arg("last_word", last_word, first_of_list=True).lower()
    for sentence in _split_sentences_like_ifeval(response):
        if not sentence or _NOT_WORD_OR_SPACE.sub("", sentence.split()[-1]).lower() != expected:
            return False
    return True


@_instruction("last_word:last_word_answer")
def response_ends_with(response: str, *, last_word: str | None = None) -> bool:
    """Passes when the response's last whitespace token, punctuation removed, is `last_word` (case-insensitive)."""
    tokens = response.split()
    expected = _text_arg("last_word", last_word).lower()
    return bool(tokens) and _NOT_WORD_OR_SPACE.sub("", tokens[-1]).lower() == expected


# ---------------------------------------------------------------------------------------------------------
# punctuation and counting


@_instruction("punctuation:punctuation_dot")
def no_dots(response: str) -> bool:
    """Passes when the response has no "." at all (also none in numbers, URLs or ellipses)."""
    return "." not in response


@_instruction("punctuation:punctuation_exclamation")
def no_exclamation_marks(response: str) -> bool:
    """Passes when the response has no "!" at all."""
    return "!" not in response


_LOWERCASE_WORD = re.compile(r"\b[a-z]+\b")


@_instruction("count:lowercase_counting")
def lowercase_words_at_most(response: str, *, N: int | None = None) -> bool:
    """Passes when the response has at most `N` all-lowercase ASCII words in total (not per distinct word).

    A lowercase word is a run of a-z between word boundaries: "the", and "don"/"t" in "don't", but not
    "The", "iPhone" or "café" (its "caf" is followed by a word character).
    """
    return len(_LOWERCASE_WORD.findall(response)) <= _int_arg("N", N)


@_instruction("letters:letter_counting")
def letter_count(response: str, *, N: int | None = None, relation: str | None = None) -> bool:
    """Passes when the number of ASCII letters (a-z, A-Z) is "less than"/"at least" `N`."""
    letters = sum(1 for char in response if char.isascii() and char.isalpha())
    return _compare(letters, _relation_arg("relation", relation), _int_arg("N", N))


@_instruction("letters:letter_counting2")
def letter_frequency(response: str, *, letter: str | None = None, let_frequency: int | None = None,
                     let_relation: str | None = None) -> bool:
    """Passes when `letter` (case-insensitive) occurs "less than"/"at least" `let_frequency` times."""
    wanted = _text_arg("letter", letter).lower()
    if len(wanted) != 1 or not ("a" <= wanted <= "z"):
        raise ValueError(f"kwarg 'letter' must be one ASCII letter, got {letter!r}")
    count = response.lower().count(wanted)
    return _compare(count, _relation_arg("let_relation", let_relation), _int_arg("let_frequency", let_frequency))


@_instruction("count:counting_composition")
def counting_composition(response: str, *, n_sent: int | None = None, n_words: int | None = None) -> bool:
    """Passes for three "***"-separated paragraphs of `n_sent` sentences, each of `n_words` nltk tokens.

    As in the original, tokens include punctuation ("The cat sat." is four) and the separator is "***"
    although the prompt shows "* * *"; any empty paragraph, even before a leading separator, fails.
    """
    sentence_count, token_count = _int_arg("n_sent", n_sent, minimum=1), _int_arg("n_words", n_words, minimum=1)
    paragraphs = _DIVIDER.split(response)
    if len(paragraphs) != 3:
        return False
    for paragraph in paragraphs:
        found = _split_sentences_like_ifeval(paragraph)
        if len(found) != sentence_count or any(len(_treebank_tokens(s)) != token_count for s in found):
            return False
    return True


@_instruction("count:count_unique")
def all_words_unique(response: str) -> bool:
    """Passes when no nltk token repeats (case-sensitive; punctuation tokens count, so two "," or "." fail)."""
    tokens = _word_tokens(response)
    return len(tokens) == len(set(tokens))
