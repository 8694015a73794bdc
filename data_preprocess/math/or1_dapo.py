"""DAPO-Math-17k and Skywork-OR1 style math data (and their merges) -> math__dapo_or1.

Accepted records, in the source datasets' own fields:
- `problem` and `answer` (e.g. a merged, deduplicated DAPO + OR1 set);
- verl-style rows: `prompt` (chat messages; the last user message holds the problem) and
  `reward_model.ground_truth`. DAPO-Math-17k wraps the problem in an "Answer: $Answer" instruction, which is
  removed; Skywork-OR1 stores the ground truth as a JSON list of accepted answers, of which the first is kept
  (all of them go to extra_info.answers).

The prompt is the bare problem followed by the \\boxed{} instruction. Problems are deduplicated (by their
whitespace-normalized text, first kept) unless --keep-duplicates is given.

    python -m data_preprocess.math.or1_dapo --input dapo-math-17k.parquet --out data
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from data_preprocess.common import BOXED, Example, RecordError, require, run_script, to_text, user_prompt

# Instructions that source datasets put around the problem (the \\boxed{} one is added back once).
_WRAPPERS = [
    re.compile(r"^\s*Solve the following math problem step by step\. The last line of your response should be of "
               r"the form Answer: \$Answer \(without quotes\) where \$Answer is the answer to the problem\.\s*"),
    re.compile(r"\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*$"),
    re.compile(r"\s*(Please|Let's think step by step and) (output|put) (the|your) final answer "
               r"within \\boxed\{\}\.?\s*$"),
]


def bare_problem(text: str) -> str:
    """The problem without the answer-format instructions the source wrapped around it."""
    for wrapper in _WRAPPERS:
        text = wrapper.sub("", text)
    return text.strip()


def accepted_answers(ground_truth: Any) -> list[str]:
    """The accepted answers: a JSON list given as text (Skywork-OR1), a list, or one answer."""
    if isinstance(ground_truth, str) and ground_truth.strip().startswith("["):
        try:
            ground_truth = json.loads(ground_truth)
        except json.JSONDecodeError:
            pass  # an answer that starts with "[", e.g. an interval
    answers = [str(answer).strip() for answer in (ground_truth if isinstance(ground_truth, list) else [ground_truth])]
    answers = [answer for answer in answers if answer]
    if not answers:
        raise RecordError(f"no answer in ground truth {ground_truth!r}")
    return answers


def problem_and_answers(record: dict[str, Any]) -> tuple[str, list[str]]:
    if "problem" in record and "answer" in record:
        problem, answer = require(record, "problem", "answer")
        return bare_problem(problem), accepted_answers(answer)
    messages, reward = require(record, "prompt", "reward_model")
    users = [message["content"] for message in messages if message.get("role") == "user"]
    if not users:
        raise RecordError("field 'prompt' has no user message")
    return bare_problem(users[-1]), accepted_answers(require(reward, "ground_truth"))


class DeduplicatingConverter:
    """Converts records, leaving out a problem seen before (unless --keep-duplicates)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, record: dict[str, Any], index: int, args: argparse.Namespace) -> Example | None:
        problem, answers = problem_and_answers(record)
        key = " ".join(problem.split())
        if key in self.seen and not args.keep_duplicates:
            return None
        self.seen.add(key)
        origin = record.get("data_source") or ""
        return Example(user_prompt(f"{problem} {BOXED}"), answers[0],
                       {"answers": to_text(answers), "origin": str(origin)})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keep-duplicates", action="store_true", help="keep repeated problems")


def main(argv: list[str] | None = None) -> Path:
    return run_script(DeduplicatingConverter(), domain="math", name="dapo_or1", description=__doc__, argv=argv,
                      add_arguments=add_arguments)


if __name__ == "__main__":
    main()
