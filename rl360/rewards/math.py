"""`math`: math-verify on the last \\boxed{} (or \\fbox{}) of the response after any </think>."""

from __future__ import annotations

import threading

from math_verify import parse, verify

from rl360.rewards.registry import register_reward


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} or \\fbox{...} (braces balanced), or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    open_at = text.find("{", start)
    if open_at < 0:
        return None
    depth = 0
    for pos in range(open_at, len(text)):
        if text[pos] == "{":
            depth += 1
        elif text[pos] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1:pos]
    return None


def _timeout() -> int | None:
    # math-verify's own timeout is a SIGALRM, which only the main thread may set; elsewhere the
    # reward pool's wall-clock limit is the guard.
    return 5 if threading.current_thread() is threading.main_thread() else None


@register_reward("math")
def math_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    answer_part = solution_str.rsplit("</think>", 1)[-1]
    pred = last_boxed(answer_part)
    if pred is None:
        return {"score": 0.0, "pred": None}
    timeout = _timeout()
    gold = parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=timeout)
    answer = parse(f"\\boxed{{{pred}}}", parsing_timeout=timeout)
    correct = bool(gold and answer and verify(gold, answer, timeout_seconds=timeout))
    return {"score": 1.0 if correct else 0.0, "pred": pred}
