"""`stem__*`: multiple choice when the ground truth is one letter A-J (GPQA, SuperGPQA, Reasoning360's
`stem__gpqa*` and `*no_box` variants), else the math checker (WebInstruct).

Multiple choice. After any </think>, the response commits to a letter in one of three ways:

- the last \\boxed{} (or \\fbox{}): \\boxed{B}, \\boxed{(B)}, \\boxed{\\text{B}}, \\boxed{B. 42 kg},
  \\boxed{(B) photon}, \\boxed{Option B}: what Reasoning360's boxed prompts ask for;
- a stated answer: "answer", or "correct" / "right" / "best" / "final" "option" / "choice", followed by ":"
  or "is" ("would be", "should be"), then on the same line (or the next, when that line ends there) the
  letter ("the first option is A" states nothing): "Answer: C" (OpenAI simple-evals' "Answer: $LETTER",
  which the `no_box` prompts ask for), "Answer: $C$", "Answer: \\(C\\)", "**Answer:** C", "**Answer: (C)**",
  "Final Answer: The correct option is B", "The final answer is (B)", "the correct answer is B.", "The
  answer is: Option C", "Answer: C) photon", "Answer: C is correct". Markdown emphasis, $ and \\( \\)
  delimiters, \\text{} and \\boxed{} around the letter are dropped. A bare letter must end its
  clause ("B.", "B,", "B" at the end of the line): "the answer is B because ..." names no choice;
- else, a "(B)" that ends the response.

Of the box and the stated answers, the one written last decides (a box or statement that names no choice,
such as \\boxed{42}, is passed over). Letters are capitals, so "the answer is a photon" names no choice,
and one letter only: when the deciding box or statement names two ("A or B", "A, C", "(A) and (C)") the
response chose nothing and scores 0.

Free-form answers go through `rl360.rewards.math.math_score`.
"""

from __future__ import annotations

import re

from rl360.rewards.extract import unwrap_latex
from rl360.rewards.math import last_boxed, math_score, strip_thinking
from rl360.rewards.registry import register_reward

SEVERAL = "several"  # the reading of a box or statement that names more than one letter
MAX_STATEMENT_CHARS = 200  # a stated answer is read from this many characters after its cue
MAX_CUES = 1000  # only the last this many "answer" cues are read (bounds the cost of odd responses)

_TRUTH_LETTER = re.compile(r"\(?([A-J])\)?")
_CUE = re.compile(r"\b(?:answer|(?:correct|right|best|final)\s+(?:option|choice))\b"
                  r"(?=[\s*_]*(?::|：|is\b|would\s+be\b|should\s+be\b|must\s+be\b))", re.IGNORECASE)
_FILLER = re.compile(r"(?:(?:is|would\s+be|should\s+be|must\s+be)\b\s*:?\s*)?"  # "is", "would be:"
                     r"(?:the\s+)?(?:(?:correct|right|best|final)\s+)*"  # "the correct"
                     r"(?:(?:answer|option|choice)\b\s*(?:is\b)?\s*:?\s*)?"  # "option is", "answer:"
                     r"(?:(?:option|choice)\b\s*)?", re.IGNORECASE)  # "Answer: Option C"
_DELIMITERS = re.compile(r"\\[()\[\]]|[$*`]|__")
_BOX_WRAPPER = re.compile(r"\\(?:boxed|fbox)\s*\{([^{}]*)\}")
_LETTER = re.compile(r"[(\[]([A-J])[)\]]|([A-J])(\))?(?![A-Za-z0-9])")
_ANOTHER_LETTER = re.compile(r"\s*(?:,|/|&|\bor\b|\band\b)\s*[(\[]?[A-J](?![A-Za-z0-9])")
_CLAUSE_END = re.compile(r"\s*(?:[.,;!:]|$)")
_IS_CORRECT = re.compile(r"\s+is\s+(?:the\s+)?(?:correct|right|best)\b", re.IGNORECASE)
_OTHER_CHOICE = re.compile(r"[(\[][A-J][)\]]|^(?:or|and|,)(?![A-Za-z])", re.IGNORECASE)
_CLOSING = re.compile(r"\(([A-J])\)[\s.*]*$")


def chosen_letter(response: str) -> str | None:
    """The multiple-choice letter a response commits to, or None (see the module doc)."""
    text = strip_thinking(response)
    readings = []  # (position, reading) of the last box and of every stated answer
    boxed = last_boxed(text)
    if boxed is not None:
        readings.append((max(text.rfind("\\boxed"), text.rfind("\\fbox")), choice_reading(boxed, in_box=True)))
    for cue in list(_CUE.finditer(text))[-MAX_CUES:]:
        readings.append((cue.start(), choice_reading(_statement_after(text, cue.end()), in_box=False)))
    committed = [reading for _, reading in sorted(readings) if reading is not None]
    if committed:
        return None if committed[-1] == SEVERAL else committed[-1]
    closing = _CLOSING.search(text)
    return closing.group(1) if closing else None


def choice_reading(text: str, in_box: bool) -> str | None:
    """The letter that `text` (a box's content, or what follows an "Answer:" cue) names, `SEVERAL` when it
    names more than one, None when it names none. A box must hold only the choice ("B", "(B)", "B. 42 kg");
    a statement may go on after the letter's clause ("B. Because ...")."""
    text = unwrap_latex(_DELIMITERS.sub("", _BOX_WRAPPER.sub(r"\1", text))).lstrip(" \t:：-–—")
    text = text[_FILLER.match(text).end():]
    letter = _LETTER.match(text)
    if not letter:
        return None
    rest = text[letter.end():]
    if _ANOTHER_LETTER.match(rest):
        return SEVERAL
    labelled = bool(letter.group(1) or letter.group(3))  # "(B)", "[B]", "B)"
    chosen = letter.group(1) or letter.group(2)
    if in_box:
        return _box_reading(chosen, rest, labelled)
    return chosen if labelled or _CLAUSE_END.match(rest) or _IS_CORRECT.match(rest) else None


def _box_reading(chosen: str, rest: str, labelled: bool) -> str | None:
    """A box names `chosen` when what follows the letter is nothing, "." / ":", or the choice's own text
    after a label ("B. 42 kg", "(B) photon"); `SEVERAL` when that text names another choice ("(B) or (C)");
    None otherwise ("B because", "AB")."""
    if rest.strip() in ("", ".", ":"):
        return chosen
    if not labelled and not rest.startswith((".", ":")):
        return None
    label_text = rest.lstrip(".:").strip()
    if not label_text or rest[:1] not in ".: ":
        return None
    return SEVERAL if _OTHER_CHOICE.search(label_text) else chosen


def _statement_after(text: str, cue_end: int) -> str:
    """The rest of the cue's line, or the next non-empty line when the cue ends its line ("**Answer:**")."""
    line_end = text.find("\n", cue_end, cue_end + MAX_STATEMENT_CHARS)
    line = text[cue_end:line_end if line_end >= 0 else cue_end + MAX_STATEMENT_CHARS]
    if line_end >= 0 and not line.strip(" \t:：*_$`"):
        following = text[line_end:line_end + MAX_STATEMENT_CHARS].strip().split("\n", 1)
        line = line + " " + following[0] if following else line
    return line[:MAX_STATEMENT_CHARS]


@register_reward("stem", truth="one option letter A-J (multiple choice), else a free-form answer (math-checked)",
                 answer="the letter of the last \\boxed{} or \"Answer: C\" / \"Final Answer: ... B\" line, whichever "
                        "is later, after any </think>; one letter only. Free-form: as `math`")
def stem_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """Multiple-choice letter or math-checked answer (see the module doc)."""
    truth = str(ground_truth).strip()
    if not truth:
        raise ValueError(f"stem: empty ground truth {ground_truth!r}")
    letter_truth = _TRUTH_LETTER.fullmatch(truth)
    if letter_truth:
        letter = chosen_letter(solution_str)
        return {"score": float(letter == letter_truth.group(1)), "pred": letter}
    return math_score(solution_str, truth, extra_info)
