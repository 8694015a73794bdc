"""Domains that Reasoning360 grades with an LLM: `stem_web*`, and `extra_info.reward_metric = "math_llm_judge"`.

Both call our judge client (`rl360.rewards.judge.judge_score`: the endpoint configured by `reward.judge`,
which the reward workers read from RL360_JUDGE_*), so they are registered with `needs_judge=True`: data
that uses them stops at start-up when no judge is configured. A judge call that fails (timeout, HTTP error,
a reply with no verdict) raises, and the reward pool scores it 0 and counts it as an error.

- `stem_web*` (WebInstruct-verified): the last \\boxed{} after any </think> is the answer (no box scores 0,
  without asking the judge, as in Reasoning360); the judge compares it with the ground truth (the reference
  answer text) for the question `extra_info["question"]`, with the template `stem_verifier`: the prompt
  layout of TIGER-Lab's general-verifier, the judge Reasoning360 serves, whose reply ends in
  "Final Decision: Yes" or "No".
- `math_llm_judge` (on `math*`): the last \\boxed{} is first compared by math-verify; a match scores 1. A
  boxed answer that math-verify does not match goes to the judge, with the template `math_grade` (a
  teacher's grading against the reference, ending "Final Grade: CORRECT" or "INCORRECT"), and the
  question `extra_info["question"]` (or `"original_question"`, which Reasoning360's math preprocessing
  writes). No box scores 0.

`extra_info["judge_template"]` overrides the template of a row.
"""

from __future__ import annotations

import re

from rl360.rewards.judge import judge_score
from rl360.rewards.judge_templates import drop_reasoning, parse_final_decision, register_template
from rl360.rewards.math import last_boxed, math_score, strip_thinking
from rl360.rewards.registry import register_reward

STEM_VERIFIER_PROMPT = """\
### Question: {question}

### Ground Truth Answer: {reference}

### Student Answer: {response}

For the question above, check whether the student's answer is equivalent to the ground truth answer. \
Do not solve the question yourself; only compare the two answers. If the student's answer is correct, \
output "Final Decision: Yes". If it is incorrect, output "Final Decision: No"."""

MATH_GRADE_PROMPT = """\
You are a teacher grading a student's answer against the reference answer.

Question: {question}

Student's Answer: {response}

Reference Answer: {reference}

Grade by the reference answer only; you need not solve the problem. An answer written differently but \
mathematically equivalent is correct; one that is not equivalent is incorrect. A range must match exactly, \
open or closed ends included. When the reference lists several solutions, the student's answer must give \
all of them. For an expression that looks equivalent, show the derivation that checks it.

Explain your grading in a few sentences, then end with one line that is exactly "Final Grade: CORRECT" or \
"Final Grade: INCORRECT"."""

_GRADE = re.compile(r"Final\s+Grade\s*\**\s*[:：]\s*\**\s*(CORRECT|INCORRECT)\b", re.IGNORECASE)


def parse_final_grade(text: str) -> float | None:
    """1.0 / 0.0 for the last "Final Grade: CORRECT" / "INCORRECT" of the reply (markdown bold allowed),
    else None."""
    grades = _GRADE.findall(drop_reasoning(text))
    return None if not grades else 1.0 if grades[-1].upper() == "CORRECT" else 0.0


register_template("stem_verifier", STEM_VERIFIER_PROMPT, parse_final_decision)
register_template("math_grade", MATH_GRADE_PROMPT, parse_final_grade)


@register_reward("stem_web", needs_judge=True,
                 truth="the reference answer text; extra_info.question holds the question",
                 answer="the last \\boxed{} after any </think> (none scores 0), judged equivalent by the LLM judge "
                        "(template stem_verifier)")
def stem_web_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """The judge's verdict on the last boxed answer (see the module doc); 0.0 without a box."""
    if last_boxed(strip_thinking(solution_str)) is None:
        return {"score": 0.0, "pred": None}
    info = dict(extra_info or {})
    if not info.get("question"):
        raise ValueError(f"stem_web: extra_info needs 'question' for the judge; it has keys {sorted(info)}")
    info["judge_template"] = info.get("judge_template") or "stem_verifier"
    return judge_score(solution_str, str(ground_truth), info)


@register_reward("math", metric="math_llm_judge", needs_judge=True,
                 truth="the final answer as LaTeX or plain text; extra_info.question (or original_question)",
                 answer="the last \\boxed{} after any </think>: math-verify, and when it finds no match, the LLM "
                        "judge (template math_grade)")
def math_llm_judge_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """math-verify on the last boxed answer, then the judge for a boxed answer it does not match."""
    checked = math_score(solution_str, ground_truth)
    if checked["score"] == 1.0 or checked["pred"] is None:
        return {**checked, "judged": False}
    info = dict(extra_info or {})
    question = info.get("question") or info.get("original_question")
    if not question:
        raise ValueError("math_llm_judge: extra_info needs 'question' (or 'original_question') for the judge; "
                         f"it has keys {sorted(info)}")
    info.update(question=question, judge_template=info.get("judge_template") or "math_grade")
    return {**judge_score(solution_str, str(ground_truth), info), "pred": checked["pred"], "judged": True}
