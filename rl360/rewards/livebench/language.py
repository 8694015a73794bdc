"""LiveBench's language tasks: connections, plot_unscrambling, typos.

Each scorer takes the response (thinking already stripped), the ground truth and the row's extra_info,
and returns a score in [0, 1].
"""

from __future__ import annotations

import re
from difflib import SequenceMatcher

from rl360.rewards.livebench.answers import (
    NEW_FORMAT_DATE,
    boxed_text,
    last_solution,
    release_date,
    solution_tags,
    truth_text,
)

GROUP_SIZE = 4
_BOLD = re.compile(r"\*\*(.*?)\*\*")
_PLOT_SUMMARY = re.compile(r"<PLOT_SUMMARY>(.*)</PLOT_SUMMARY>", re.DOTALL)
_PLOT_SUMMARY_OPEN = re.compile(r"<PLOT_SUMMARY>(.*)", re.DOTALL)
_NOT_SENTENCES = ("</PLOT_SUMMARY>", "**End of Plot Summary**")
_DASHED = re.compile(r".* --- (.*?) --- .*")


def connections_score(response: str, ground_truth, extra_info: dict) -> float:
    """16 words, comma-separated in the truth, four groups of four in order; the fraction of the truth's groups
    the answer has. Before 2024-11-25 (and without a release date, as Reasoning360 scores it) the answer is a
    bold list and the best bold list counts; from then on it is the list in <solution> (or \\boxed{})."""
    words = truth_text(ground_truth, "connections").split(",")
    wanted = _groups(words)
    released = release_date(extra_info)
    if released is not None and released >= NEW_FORMAT_DATE:
        return _connections_solution(response, wanted, len(words))
    return _connections_bold(response, wanted)


def plot_unscrambling_score(response: str, ground_truth, extra_info: dict) -> float:
    """The plot's sentences in their right order (inside <PLOT_SUMMARY> when present); each truth sentence is
    matched to its most similar answer sentence, and the score is 1 - (edit distance between the truth's order
    and the matched positions) / (number of truth sentences)."""
    wanted = _sentences(truth_text(ground_truth, "plot_unscrambling"))
    if not wanted:
        raise ValueError(f"livebench plot_unscrambling: ground truth has no sentences: {ground_truth!r}")
    summary = _PLOT_SUMMARY.search(response) or _PLOT_SUMMARY_OPEN.search(response)
    given = [s for s in _sentences(summary.group(1) if summary else response) if s not in _NOT_SENTENCES]
    order = [_most_similar(sentence, given) for sentence in wanted] if given else []
    return max(0.0, 1 - edit_distance(list(range(len(wanted))), order) / len(wanted))


def typos_score(response: str, ground_truth, extra_info: dict) -> float:
    """The corrected text; the answer is the last <solution> (else the response, or the text between
    " --- " markers), lines joined by spaces; 1.0 when it contains the truth (lines joined alike), else 0.0."""
    truth = _join_lines(truth_text(ground_truth, "typos"))
    answer = last_solution(response)
    if answer is None:
        answer = response.replace("<solution>", "").replace("</solution>", "")
        dashed = _DASHED.search(answer)
        answer = dashed.group(1) if dashed else answer
    return float(truth in _join_lines(answer))


def edit_distance(a: list, b: list) -> int:
    """Levenshtein distance between two sequences (insertions, deletions and substitutions cost 1)."""
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def _connections_bold(response: str, wanted: list[set[str]]) -> float:
    """Best over the bold spans, each read as a comma-separated list grouped by four: the fraction of the truth's
    groups found among its groups."""
    best = 0.0
    for span in _BOLD.findall(response.replace("\n", "")):
        groups = _groups(span.split(","))
        best = max(best, sum(group in groups for group in wanted) / len(wanted))
    return best


def _connections_solution(response: str, wanted: list[set[str]], n_words: int) -> float:
    """The words of the <solution> tags (several are read as one list, its last `n_words` kept), else of
    \\boxed{}; the fraction of the truth's groups among the answer's groups (a group repeated counts once)."""
    tagged = [text.replace("\n", "") for text in solution_tags(response)]
    if tagged:
        words = [word for text in tagged for word in text.split(",")][-n_words:]
    elif (boxed := boxed_text(response)) is not None:
        words = boxed.replace("\n", "").split(",")
    else:
        return 0.0
    groups = _groups(words)
    return sum(group in groups for group in wanted) / len(wanted)


def _groups(words: list[str]) -> list[set[str]]:
    cleaned = [word.strip().lower() for word in words]
    return [set(cleaned[start:start + GROUP_SIZE]) for start in range(0, len(cleaned), GROUP_SIZE)]


def _sentences(text: str) -> list[str]:
    return [sentence.strip() for sentence in text.split(".") if sentence.strip()]


def _most_similar(sentence: str, candidates: list[str]) -> int:
    """Index of the candidate most similar to `sentence` (difflib's ratio; the first of equals)."""
    ratios = [SequenceMatcher(None, candidate, sentence).ratio() for candidate in candidates]
    return ratios.index(max(ratios))


def _join_lines(text: str) -> str:
    return " ".join(line for line in text.strip().split("\n") if line)
