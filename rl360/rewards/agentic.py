"""Rewards of tool-using vision agents, graded by the LLM judge: DeepEyes' and PyVision's.

Both read the trajectory when the rollout was multi-turn (`extra_info["trajectory"]`, which the reward pool adds
from the sample: each generated turn's text and the tool calls, `rl360.core.TrajectorySummary`), so tool replies
never count as the model's answer or format, and tool use is the calls the agent loop ran. Without it (a single
response, `rl360 reward check`), the response text is the one turn and a `<tool_call>` in it counts as tool use.

- **DeepEyes** (`deepeyes_score`; the verl deepeyes recipe's reward): `accuracy_weight * acc + format_weight *
  format + tool_weight * tool`, by default 0.8, 0.2 and 1.2 (`reward.deepeyes.*`). `acc` is the judge's verdict
  (template `deepeyes`: one word, CORRECT or INCORRECT) on the answer of the last turn: the first
  `<answer>...</answer>` after its last `</think>` (without one, that text with its tool calls taken out).
  `format` is -1 when the `<think>` tags of the generated text do not pair up, when the last turn's `<answer>`
  tags do not, when it has no `<answer>...</answer>`, or when the answer reaches `max_answer_chars` characters
  (which also scores `acc` 0: a long answer is an attempt to sway the judge), else 0. `tool` is 1 when the
  trajectory called a tool and `acc` is 1, else 0: tool use pays only when the answer is right.
- **PyVision** (`pyvision_score`; its `vl_agent` reward): the judge's verdict alone (template `pyvision`: the
  judge replies "Judgement: 1" or "0") on the first `<answer>...</answer>` of the generated text. No answer, an
  answer holding `<interpreter>`, `<answer>` or `\\boxed`, or one of 1000 characters or more (as PyVision),
  scores 0 without asking the judge.

Routes: the data_source names of DeepEyes' data (`vstar`, `chart`, `thinklite_eureka`, `vl_agent`, and
`hiyouga/DeepEyes-Datasets-47k`, which verl's DeepEyes recipe writes on every row) score with DeepEyes' reward;
PyVision's own (`deepeyes`, `zebra_cot`, `vigorl`, `minio3`, ...) with PyVision's; a row with
`extra_info.reward_metric = "pyvision"` (PyVision's preprocessing writes it) or `"deepeyes"` on DeepEyes' names
picks either. Both return the extras `acc` (what DAPO's dynamic sampling reads) and `answer`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from rl360.rewards.judge import judge_answer
from rl360.rewards.judge_templates import drop_reasoning, parse_correct_word, register_template
from rl360.rewards.math import generated_turns, math_score
from rl360.rewards.registry import register_reward

ENV = "RL360_DEEPEYES_REWARD"  # the weights, as JSON, from `reward.deepeyes` (`deepeyes_env`)


@dataclass(frozen=True)
class DeepEyesWeights:
    accuracy_weight: float = 0.8
    format_weight: float = 0.2
    tool_weight: float = 1.2
    max_answer_chars: int = 1000


def deepeyes_env(cfg: Any) -> dict[str, str]:
    """The reward workers' setting for DeepEyes' weights from a `reward.deepeyes` config section."""
    names = DeepEyesWeights.__dataclass_fields__
    return {ENV: json.dumps({name: getattr(cfg, name) for name in names if hasattr(cfg, name)})}


def deepeyes_weights() -> DeepEyesWeights:
    """This process's weights: RL360_DEEPEYES_REWARD, else the defaults."""
    text = os.environ.get(ENV, "")
    return DeepEyesWeights(**json.loads(text)) if text else DeepEyesWeights()


DEEPEYES_PROMPT = """\
You are an expert evaluator. Decide whether a model's answer to a question means the same as the standard \
answer. Be strict: the model's answer is correct only if it fully matches the meaning of the standard answer; \
a short answer that carries that meaning ("tan" for "The countertop is tan.") is correct.

Question: {question}
Standard answer: {reference}
Model's answer: {response}

Reply with exactly one word: CORRECT or INCORRECT."""

PYVISION_PROMPT = """\
Below are a question, its standard answer and a model's answer. Decide whether the two answers are consistent: \
they are when they mean essentially the same thing, however it is worded ("pink" and "it is pink"). Reply \
"Judgement: 1" if they are consistent and "Judgement: 0" if they are not, and nothing else.

[Question]: Is the kite brown and large?
[Standard Answer]: Yes, the kite is brown and large.
[Model_answer]: Yes
Judgement: 1

[Question]: What color is the towel in the center of the picture?
[Standard Answer]: The towel in the center of the picture is blue.
[Model_answer]: The towel in the center of the picture is pink.
Judgement: 0

[Question]: {question}
[Standard Answer]: {reference}
[Model_answer]: {response}
Judgement:"""

_JUDGEMENT = re.compile(r"(?:Judgement\s*:\s*)?\**\s*([01])\b")


def parse_judgement(text: str) -> float | None:
    """1.0 / 0.0 for the reply's "Judgement: 1" / "0" (the last one), or a bare 1 / 0; else None."""
    reply = drop_reasoning(text)
    if "Judgement" in reply:
        reply = reply.rsplit("Judgement", 1)[1]
    found = _JUDGEMENT.search(reply)
    return None if found is None else float(found.group(1))


register_template("deepeyes", DEEPEYES_PROMPT, parse_correct_word)
register_template("pyvision", PYVISION_PROMPT, parse_judgement)

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


def used_tools(solution_str: str, extra_info: dict | None) -> bool:
    """Whether the trajectory called a tool (its calls; without a trajectory, a `<tool_call>` in the text)."""
    trajectory = (extra_info or {}).get("trajectory")
    if isinstance(trajectory, dict):
        return int(trajectory.get("num_tool_calls", 0)) > 0
    return _TOOL_CALL.search(solution_str) is not None


def _question(extra_info: dict | None, source: str) -> str:
    question = (extra_info or {}).get("question")
    if not question:
        raise ValueError(f"{source}: extra_info needs 'question' for the judge; it has keys {sorted(extra_info or {})}")
    return str(question)


@register_reward("vstar", "chart", "thinklite_eureka", "vl_agent", "hiyouga/DeepEyes-Datasets-47k", exact=True,
                 needs_judge=True,
                 truth="the reference answer text; extra_info.question holds the question",
                 answer="DeepEyes: 0.8 judge accuracy (CORRECT/INCORRECT) on the last turn's <answer> + 0.2 format "
                        "(-1 on a tag error) + 1.2 when a tool was called and the answer is right (reward.deepeyes.*)")
@register_reward("vstar", "chart", "thinklite_eureka", "vl_agent", exact=True, metric="deepeyes", needs_judge=True,
                 truth="the reference answer text; extra_info.question holds the question",
                 answer="DeepEyes' reward (as the default route of vstar)")
def deepeyes_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """DeepEyes' judge accuracy, format and tool bonus (see the module doc)."""
    weights = deepeyes_weights()
    turns = generated_turns(solution_str, extra_info)
    generated = "\n".join(turns)
    last = turns[-1].split("</think>")[-1].strip()
    format_error = generated.count("<think>") != generated.count("</think>")
    format_error |= last.count("<answer>") != last.count("</answer>")
    found = _ANSWER.search(last)
    if found is not None:
        answer = found.group(1).strip()
    else:
        format_error = True
        answer = _TOOL_CALL.sub("", last).strip() or generated.strip()
    too_long = len(answer) >= weights.max_answer_chars
    if too_long:
        format_error, acc, verdict = True, 0.0, ""
    else:
        result = judge_answer("deepeyes", _question(extra_info, "deepeyes"), str(ground_truth), answer)
        acc, verdict = float(result.score), result.text[:200]
    tool = 1.0 if used_tools(solution_str, extra_info) and acc > 0.5 else 0.0
    score = (weights.accuracy_weight * acc - weights.format_weight * float(format_error)
             + weights.tool_weight * tool)
    return {"score": score, "acc": acc, "format_error": format_error, "tool_reward": tool,
            "answer": answer[:200], "judge_text": verdict}


_PYVISION_REFUSED = ("<interpreter>", "<answer>", "\\boxed")
PYVISION_MAX_ANSWER_CHARS = 1000


# the wemath-2.0-* names as PyVision-RL's verl_agents/verl/utils/reward_score/__init__.py routes them
_PYVISION_SOURCES = ("deepeyes", "zebra_cot", "vigorl", "minio3", "vsi", "longvila", "ecd", "v-interaction", "barc",
                     "mathvision", "hrbench-4k", "hrbench-8k", "math_8k_verified", "wemath-standard", "wemath-pro",
                     "wemath-2.0-standard", "wemath-2.0-pro")


@register_reward(*_PYVISION_SOURCES, exact=True, needs_judge=True,
                 truth="the reference answer text; extra_info.question holds the question",
                 answer="PyVision: the judge's verdict (Judgement: 1 or 0) on the first <answer> of the generated "
                        "text; none, a nested tag or \\boxed, or 1000+ characters scores 0")
@register_reward("vstar", "chart", "thinklite_eureka", "vl_agent", *_PYVISION_SOURCES, exact=True,
                 metric="pyvision", needs_judge=True,
                 truth="the reference answer text; extra_info.question holds the question",
                 answer="PyVision's reward (as the default route of deepeyes)")
def pyvision_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """PyVision's judge accuracy (see the module doc)."""
    found = _ANSWER.search("\n".join(generated_turns(solution_str, extra_info)))
    answer = found.group(1).strip() if found else None
    if answer is None or any(tag in answer for tag in _PYVISION_REFUSED) \
            or len(answer) >= PYVISION_MAX_ANSWER_CHARS:
        return {"score": 0.0, "acc": 0.0, "answer": (answer or "")[:200], "judged": False}
    result = judge_answer("pyvision", _question(extra_info, "pyvision"), str(ground_truth), answer)
    return {"score": float(result.score), "acc": float(result.score), "answer": answer[:200], "judged": True}


@register_reward("math", metric="tool_bonus", truth="the answer as a LaTeX/plain string",
                 answer="the math reward's accuracy (the last \\boxed{} of the generated turns) + DeepEyes' tool bonus "
                        "(reward.deepeyes.tool_weight, 1.2) when a tool was called and the answer is right")
def math_tool_bonus_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """The `math` reward's accuracy plus DeepEyes' tool bonus: `reward.deepeyes.tool_weight` when the trajectory
    called a tool and its answer is right (tool use pays only with a right answer). Extras: `acc`, `pred`."""
    result = math_score(solution_str, ground_truth, extra_info)
    acc = result["score"]
    bonus = deepeyes_weights().tool_weight if acc > 0 and used_tools(solution_str, extra_info) else 0.0
    return {"score": acc + bonus, "acc": acc, "pred": result["pred"]}
