"""Judge prompt templates: a `str.format` prompt and a parser from the judge's reply to a score.

Built in (fields `question`, `reference`, `response`):
- `correctness`: the judge answers with one word, "Correct" (score 1) or "Incorrect" (score 0), as in the
  DeepVision re-judge of math-verify's misses.
- `verifier`: the judge reasons briefly and ends with "Final Decision: Yes" (1) or "Final Decision: No" (0),
  as the PyVision / DeepEyes judges do.

Either parser first drops a reasoning judge's `<think> ... </think>` block; a reply that gives no verdict
parses to None (the item fails as `unparseable`, it does not score 0 silently).

    register_template("strict", "Q: {question}\\nA: {response}\\nAnswer Yes or No.",
                      lambda text: 1.0 if text.strip().lower().startswith("yes") else 0.0)
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable
from dataclasses import dataclass

Parser = Callable[[str], float | None]


@dataclass(frozen=True)
class Template:
    name: str
    prompt: str  # str.format fields, e.g. {question} {reference} {response}
    parse: Parser  # the judge's text -> score, None when it gives no verdict
    fields: frozenset[str]  # the field names the prompt needs

    def render(self, fields: dict) -> str:
        return self.prompt.format_map(fields)


def drop_reasoning(text: str) -> str:
    """The reply after the last </think> (reasoning judges such as Qwen3 or R1 think first), stripped."""
    return text.rsplit("</think>", 1)[-1].strip()


_WORD = re.compile(r"[A-Za-z]+")
_DECISION = re.compile(r"Final\s+Decision\s*\**\s*[:：]\s*\**\s*(Yes|No)\b", re.IGNORECASE)


def parse_correct_word(text: str) -> float | None:
    """1.0 when the reply's first word is "Correct", 0.0 for "Incorrect" (any case, markdown or punctuation
    around it), else None."""
    word = _WORD.search(drop_reasoning(text))
    verdict = word.group(0).lower() if word else ""
    return 1.0 if verdict == "correct" else 0.0 if verdict == "incorrect" else None


def parse_final_decision(text: str) -> float | None:
    """1.0 / 0.0 for the last "Final Decision: Yes" / "No" of the reply (markdown bold allowed), else None."""
    decisions = _DECISION.findall(drop_reasoning(text))
    return None if not decisions else 1.0 if decisions[-1].lower() == "yes" else 0.0


CORRECTNESS_PROMPT = """\
You are grading a model's answer against a reference answer.

Decide only whether the model's answer means the same as the reference answer for this question. \
Equivalent forms count as the same (1/2 and 0.5, a unit written another way, reordered terms, an option \
letter with or without its text). A different value, an incomplete answer, or several candidate answers \
count as different. Do not solve the question yourself and do not judge the reasoning.

Question: {question}
Reference answer: {reference}
Model answer: {response}

Reply with exactly one word: Correct or Incorrect."""

VERIFIER_PROMPT = """\
You are verifying whether a model's answer to a question agrees with the reference answer.

Compare the final answers only. Equivalent forms agree (1/2 and 0.5, a unit written another way, \
reordered terms, an option letter with or without its text); a different value, an incomplete answer, or \
several candidate answers do not agree.

Question: {question}
Reference answer: {reference}
Model answer: {response}

Explain the comparison in a few sentences, then end your reply with one line that is exactly \
"Final Decision: Yes" if the answers agree or "Final Decision: No" if they do not."""


TEMPLATES: dict[str, Template] = {}


def register_template(name: str, prompt: str, parse: Parser) -> Template:
    """Add (or replace) the template `name`: `prompt` with `str.format` fields, `parse` from the judge's
    reply to a score in [0, 1], or None when the reply gives no verdict. A worker process that judges must
    register it too: do it at import time of the module that holds your reward function."""
    if not name or not isinstance(name, str):
        raise ValueError(f"judge template name must be a non-empty string, got {name!r}")
    if not callable(parse):
        raise TypeError(f"judge template {name!r}: parse must be callable, got {type(parse).__name__}")
    try:
        fields = frozenset(field for _, field, _, _ in string.Formatter().parse(prompt) if field is not None)
    except ValueError as err:
        raise ValueError(f"judge template {name!r}: prompt is not a valid format string: {err}") from None
    bad = sorted(field for field in fields if not field.isidentifier())
    if bad:
        raise ValueError(f"judge template {name!r}: fields must be plain names, got {bad} "
                         "(write a literal brace as {{ or }})")
    template = Template(name, prompt, parse, fields)
    TEMPLATES[name] = template
    return template


def get_template(name: str) -> Template:
    try:
        return TEMPLATES[name]
    except KeyError:
        raise KeyError(f"unknown judge template {name!r}; registered: {sorted(TEMPLATES)}") from None


register_template("correctness", CORRECTNESS_PROMPT, parse_correct_word)
register_template("verifier", VERIFIER_PROMPT, parse_final_decision)
