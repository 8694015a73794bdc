"""`searchR1_*`: exact match of the last <answer>...</answer> against the accepted answers (Search-R1, verl).

The response's answer is the content of its last `<answer>...</answer>` after any </think> (none, or an
unclosed last `<answer>`, scores 0). It and every accepted answer are normalised as SQuAD's evaluation does:
lower case, punctuation removed, the articles "a", "an", "the" removed, whitespace collapsed. It scores 1.0
when it equals one of them.

The ground truth is `{"target": answers}` as verl's Search-R1 preprocessing stores it, `answers` a list (a
numpy array when pandas read the file) or one string; the same as JSON text or a Python literal (how a
stringified struct reads) is accepted too. verl gives a right answer only 0.25 when the response holds more
than 10 `<answer>` tags; here only the last one counts, so repeating the tag gains nothing and a right last
answer scores 1.0.
"""

from __future__ import annotations

import re
import string

from rl360.rewards.extract import last_answer_tag, parse_truth
from rl360.rewards.registry import register_reward

SEARCH_R1_SOURCES = ("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
                     "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


@register_reward(*SEARCH_R1_SOURCES, exact=True,
                 truth="{\"target\": [accepted answers]} (a list, array or one string; a dict, JSON or a literal)",
                 answer="the last <answer>...</answer>, equal to one accepted answer after SQuAD normalisation")
def search_r1_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """1.0 when the last <answer> matches an accepted answer (see the module doc), else 0.0."""
    targets = accepted_answers(ground_truth)
    pred = last_answer_tag(solution_str)
    if pred is None:
        return {"score": 0.0, "pred": None}
    normalized = normalize_answer(pred)
    return {"score": float(any(normalize_answer(target) == normalized for target in targets)), "pred": pred}


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = str(text).lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def accepted_answers(ground_truth) -> list[str]:
    """The accepted answers of a `{"target": ...}` ground truth; `ValueError` naming what is wrong."""
    truth = parse_truth(ground_truth, "searchR1")
    if not isinstance(truth, dict) or "target" not in truth:
        raise ValueError(f"searchR1: ground truth must be {{'target': [answers]}}, got {str(ground_truth)[:120]!r}")
    target = truth["target"]
    if hasattr(target, "tolist"):  # a numpy array
        target = target.tolist()
    answers = [target] if isinstance(target, str) else target
    if not isinstance(answers, (list, tuple)) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"searchR1: ground truth 'target' must be a non-empty list of strings (or one string), "
                         f"got {str(target)[:120]!r}")
    return list(answers)
