"""Code simulation rewards (Reasoning360 names).

- `simulation__codeio*`: truth `{"output": v}` or `{"input": v}`; the response's last JSON object (after any
  </think>) must hold the same key with an equal value (numbers within 1e-4 relative, strings normalised).
- `simulation__cruxeval*`: truth `{"code", "input", "output"}`; the answer is the last <answer> … </answer>.
  Output prediction (`extra_info["task"] == "output"`, data_source `..._o`): the answer as a Python literal
  equals `output`. Input prediction (`"input"`, `..._i`): `f(<answer>) == <output>` holds when run in the
  sandbox (model text is never evaluated in this process).
- `simulation__arcagi*`: truth a grid, a JSON list of lists of ints (no preprocessing script ships here;
  this is the format to write); the answer is the last such grid in the <answer> tag, or after </think>,
  and must equal it cell for cell.
"""

from __future__ import annotations

import ast

from rl360.rewards.extract import after_thinking, last_answer_tag, last_json_value, parse_truth, values_equal
from rl360.rewards.registry import register_reward
from rl360.rewards.remote_sandbox import run_python_code
from rl360.rewards.sandbox import SandboxLimits

CRUXEVAL_TIMEOUT_S = 5.0


@register_reward("simulation__codeio")
def codeio_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    truth = parse_truth(ground_truth, "simulation__codeio")
    if not isinstance(truth, dict) or len(truth) != 1 or next(iter(truth)) not in ("input", "output"):
        raise ValueError(f"simulation__codeio: ground truth must be {{'output': ...}} or {{'input': ...}}, got "
                         f"{str(ground_truth)[:120]!r}")
    key, want = next(iter(truth.items()))
    answer = last_json_value(after_thinking(solution_str), "{")
    correct = isinstance(answer, dict) and key in answer and values_equal(answer[key], want)
    return {"score": float(correct)}


@register_reward("simulation__cruxeval")
def cruxeval_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    truth = parse_truth(ground_truth, "simulation__cruxeval")
    if not isinstance(truth, dict) or not {"code", "input", "output"} <= truth.keys():
        raise ValueError(f"simulation__cruxeval: ground truth needs code, input and output, got "
                         f"{str(ground_truth)[:120]!r}")
    answer = last_answer_tag(solution_str)
    if not answer:
        return {"score": 0.0, "failure": "no <answer>"}
    task = (extra_info or {}).get("task", "output")
    if task == "output":
        return {"score": float(_literals_equal(answer, truth["output"]))}
    program = f"{truth['code']}\n\nassert f({answer}) == {truth['output']}\n"
    result = run_python_code(program, limits=SandboxLimits(timeout_s=CRUXEVAL_TIMEOUT_S))
    return {"score": float(result.ok), **({} if result.ok else {"failure": "assertion failed or error"})}


def _literals_equal(answer: str, expected: str) -> bool:
    try:
        return ast.literal_eval(answer) == ast.literal_eval(expected)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return " ".join(answer.split()) == " ".join(str(expected).split())


@register_reward("simulation__arcagi")
def arcagi_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    truth = parse_truth(ground_truth, "simulation__arcagi")
    if not _is_grid(truth):
        raise ValueError(f"simulation__arcagi: ground truth must be a list of lists of ints, got "
                         f"{str(ground_truth)[:120]!r}")
    region = last_answer_tag(solution_str) or after_thinking(solution_str)
    grid = _last_grid(region)
    return {"score": float(grid == truth)}


def _is_grid(value) -> bool:
    return (isinstance(value, list) and bool(value) and all(isinstance(row, list) for row in value)
            and all(isinstance(cell, int) and not isinstance(cell, bool) for row in value for cell in row))


def _last_grid(text: str) -> list | None:
    end = len(text)
    while end > 0:
        end = text.rfind("]]", 0, end)
        if end < 0:
            return None
        start = text.rfind("[[", 0, end)
        while start >= 0:
            try:
                value = ast.literal_eval(text[start:end + 2])
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                start = text.rfind("[[", 0, start)
                continue
            if _is_grid(value):
                return value
            start = text.rfind("[[", 0, start)
        end -= 1
    return None
