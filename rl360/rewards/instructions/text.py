"""Small text utilities shared by the instruction-following checks (IFEval, IFBench).

Definitions used by every check:

- A *word* is a maximal run of Unicode word characters (`\\w+`: letters, digits, underscore), so
  "don't" is two words ("don", "t"), "3.14" is two ("3", "14"), "state-of-the-art" is four, and
  punctuation, markdown marks and emoji are not words. This is the count IFEval uses.
- A *sentence* ends at a run of terminal punctuation (`.`, `!`, `?`, e.g. "?!" or "..."), optionally
  followed by closing quotes, brackets or markdown emphasis (`" ' ” ’ ) ] * _`), then whitespace or the
  end of the text. A single `.` does not end a sentence after a title or Latin abbreviation ("Mr.",
  "Dr.", "e.g.", "i.e.", "vs.", "approx."), after an initial or dotted acronym ("J. K. Rowling",
  "U.S."), or after a numbered-list marker at the start of a line ("1. "); after "etc.", "Inc.", "Ltd.",
  "Jr.", "Sr.", "Co." it ends one only when the next word is capitalised. A decimal such as "3.14" has no
  space after its dot, so it never splits. Newlines do not end sentences by themselves (a heading
  without punctuation joins the next sentence, as in IFEval's and nltk's splitters); text after the last
  terminal punctuation is a sentence of its own, and a piece without any word character is not one.
- A *paragraph* is a run of text between blank lines (a line holding only whitespace counts as blank),
  or, given a `separator` such as "***" or "* * *", between occurrences of that exact string; each
  paragraph is stripped of surrounding whitespace and empty ones are dropped.
"""

from __future__ import annotations

import re

_WORD = re.compile(r"\w+")
_SENTENCE_END = re.compile(r"[.!?]+[\"'”’)\]*_]*(?=\s|$)")
_LAST_TOKEN = re.compile(r"(\S+)$")
_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n\s*")
_DOTTED_LETTERS = re.compile(r"(?:[^\W\d_]\.)*[^\W\d_]")  # "J", "U.S", "e.g" (the final dot excluded)

# Abbreviations after which "." never ends a sentence (titles before names, Latin and reference forms).
_NEVER_FINAL = frozenset({
    "mr", "mrs", "ms", "mx", "dr", "prof", "rev", "hon", "gen", "col", "capt", "lt", "sgt", "st", "mt",
    "vs", "cf", "approx", "fig", "figs", "eq", "eqs", "no", "nos", "vol", "ch", "sec", "pp", "ph.d",
    "e.g", "i.e", "viz", "ca",
})
# Abbreviations that often close a sentence: "." ends one only before a capitalised word (or the end).
_MAYBE_FINAL = frozenset({"etc", "inc", "ltd", "jr", "sr", "co", "corp", "al"})


def words(text: str) -> list[str]:
    """The words of `text`: maximal runs of `\\w` characters, in order."""
    return _WORD.findall(text)


def count_words(text: str) -> int:
    """How many words `text` has (see `words`)."""
    return sum(1 for _ in _WORD.finditer(text))


def sentences(text: str) -> list[str]:
    """The sentences of `text`, stripped, in order (the module docstring says where one ends)."""
    found: list[str] = []
    start = 0
    for match in _SENTENCE_END.finditer(text):
        if not _ends_sentence(text, match):
            continue
        _append_sentence(found, text[start:match.end()])
        start = match.end()
    _append_sentence(found, text[start:])
    return found


def count_sentences(text: str) -> int:
    """How many sentences `text` has (see `sentences`)."""
    return len(sentences(text))


def paragraphs(text: str, separator: str | None = None) -> list[str]:
    """The non-empty paragraphs of `text`, stripped: split on blank lines, or on the literal `separator`."""
    if separator is None:
        pieces = _BLANK_LINE.split(text)
    else:
        if not separator:
            raise ValueError("paragraphs: separator must be a non-empty string or None")
        pieces = text.split(separator)
    return [piece.strip() for piece in pieces if piece.strip()]


def count_paragraphs(text: str, separator: str | None = None) -> int:
    """How many paragraphs `text` has (see `paragraphs`)."""
    return len(paragraphs(text, separator))


def lowercase_ratio(text: str) -> float:
    """Fraction of the cased letters in `text` that are lowercase (1.0 when it has no cased letter)."""
    lower, upper = _cased_counts(text)
    return 1.0 if lower + upper == 0 else lower / (lower + upper)


def uppercase_ratio(text: str) -> float:
    """Fraction of the cased letters in `text` that are uppercase (0.0 when it has no cased letter)."""
    lower, upper = _cased_counts(text)
    return 0.0 if lower + upper == 0 else upper / (lower + upper)


def _cased_counts(text: str) -> tuple[int, int]:
    lower = sum(1 for ch in text if ch.islower())
    upper = sum(1 for ch in text if ch.isupper())
    return lower, upper


def _append_sentence(found: list[str], piece: str) -> None:
    piece = piece.strip()
    if _WORD.search(piece):
        found.append(piece)


def _ends_sentence(text: str, match: re.Match[str]) -> bool:
    """Whether the terminal punctuation at `match` closes a sentence (abbreviations, initials, list markers)."""
    punctuation = match.group(0).rstrip("\"'”’)]*_")
    if punctuation != ".":  # "!", "?", "?!", "..." always end one
        return True
    before = _LAST_TOKEN.search(text, 0, match.start())
    if before is None:
        return True
    token = before.group(1).lstrip("\"'“‘([*_")
    lowered = token.lower()
    if lowered in _NEVER_FINAL or _DOTTED_LETTERS.fullmatch(token):
        return False
    if lowered in _MAYBE_FINAL:
        following = text[match.end():].lstrip()
        return not following or following[0].isupper()
    if token.isdigit() and _starts_line(text, before.start()):  # "1. First step"
        return False
    return True


def _starts_line(text: str, position: int) -> bool:
    line_start = text.rfind("\n", 0, position) + 1
    return not text[line_start:position].strip()
