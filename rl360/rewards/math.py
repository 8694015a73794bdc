"""Math answers compared with math-verify: the `math*` prefix, verl's MATH / DAPO / AIME / NuminaMath names.

Two ways of reading the answer:

- `math_score` (`math*`, `lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`, `HuggingFaceH4/MATH-500`):
  the last \\boxed{} (or \\fbox{}) of the response after any </think>; no box scores 0.
- `stated_math_score` (`math`, `math_dapo`, `math_dapo_reasoning`, `aime*`, the six `numina_*` names, and
  `extra_info.reward_metric = "prime_math"` on `math*`): the last \\boxed{}, or a later "Answer: X" /
  "the answer is X" (to the end of its line; a `$...$` in it is taken as the answer, so Minerva's "Final
  Answer: The final answer is $34$. I hope it is correct." reads 34), whichever comes last. verl's
  math_dapo reads only "Answer: X" and scores -1 / 1; here both forms count and scores are 0 / 1.

Either way the answer is compared with the ground truth (a string; one holding a \\boxed{} is reduced to its
content) by math-verify, under one time limit.

Timeouts. math-verify 0.9.0 guards `parse` (`parsing_timeout=5`) and `verify` (`timeout_seconds=5`, per
gold x prediction pair) with `signal.alarm`: whole seconds, one alarm per operation (so one call can
take several times the limit), `signal.alarm(0)` afterwards cancels any timer the caller had armed,
and outside the main thread `signal.signal` fails, which math-verify re-raises as a `ValueError`.
Here math-verify runs with both timeouts off (`None`), and one `time_limit` covers the whole comparison:
an `ITIMER_REAL` timer (sub-second) in the main thread, which is where reward-pool workers and plain
in-process calls run; a timer the caller had armed is put back with its remaining time. In any other
thread no signal can be used, so the call runs unguarded and the reward pool's wall-clock limit (a
worker is killed) is the guard. A comparison past the limit scores 0.
"""

from __future__ import annotations

import logging
import numbers
import re
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from math_verify import parse, verify

from rl360.rewards.registry import register_reward

TIMEOUT_S = 5.0  # budget of one whole comparison (both parses and the verify), main thread only
_BOXES = ("\\boxed", "\\fbox")
_STATED = re.compile(r"\banswer\s*(?:is\b\s*:?|:)[ \t]*([^\n]*\S)", re.IGNORECASE)  # "Answer: X", "answer is X"
_DOLLARS = re.compile(r"\$([^$]+)\$")
NUMINA_SOURCES = ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                  "numina_cn_k12", "numina_olympiads")
_BOXED_TRUTH = ("the final answer as LaTeX or plain text, e.g. `\\frac{1}{2}` (one holding a \\boxed{} counts by "
                "its content)")
logger = logging.getLogger(__name__)


class MathTimeout(BaseException):
    """Raised by `time_limit`; a BaseException so math-verify's `except Exception` cannot swallow it."""


def strip_thinking(text: str) -> str:
    """The text after the last </think>, or all of it when there is none."""
    return text.rsplit("</think>", 1)[-1]


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} or \\fbox{...} (braces balanced, \\{ and \\} skipped), or None.

    `\\boxed 5` (a single token, no braces) gives "5"; an unclosed last box gives None.
    """
    start = max(text.rfind(box) for box in _BOXES)
    if start < 0:
        return None
    name_end = start + len("\\boxed" if text.startswith("\\boxed", start) else "\\fbox")
    pos = name_end
    while pos < len(text) and text[pos] in " \t":
        pos += 1
    if pos < len(text) and text[pos] != "{" and pos > name_end:  # \boxed 5: one token
        return text[pos:].split(maxsplit=1)[0].split("$", 1)[0]
    if pos >= len(text) or text[pos] != "{":
        return None
    depth = 0
    index = pos
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2  # an escaped character, e.g. \{ or \}, never opens or closes the box
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[pos + 1:index]
        index += 1
    return None


@contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise `MathTimeout` in the body after `seconds` (main thread only; elsewhere, or with None/<=0,
    no limit). A real-time timer armed by the caller is restored with its remaining time; if it would
    fire first, it is left alone and no limit of ours is set."""
    if not seconds or seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return
    outer_delay, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    if 0 < outer_delay <= seconds:
        yield
        return
    armed = True

    def on_alarm(signum: int, frame: object) -> None:
        nonlocal armed
        if armed:  # fires at most once, and never once the body has finished
            armed = False
            raise MathTimeout(f"math comparison took longer than {seconds:g} s")

    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        while True:  # a MathTimeout arriving during the clean-up itself is dropped and the clean-up redone
            try:
                armed = False
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
                if outer_delay > 0:
                    remaining = max(outer_delay - (time.monotonic() - started), 1e-3)
                    signal.setitimer(signal.ITIMER_REAL, remaining, outer_interval)
                break
            except MathTimeout:
                continue


def is_equiv(pred: str, ground_truth: str) -> bool:
    """math-verify's verdict on a boxed-answer string against a ground-truth string, without timeouts of
    its own (wrap in `time_limit`)."""
    gold = parse(_as_boxed(ground_truth), parsing_timeout=None)
    answer = parse(_as_boxed(pred), parsing_timeout=None)
    return bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=None)


@register_reward("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", exact=True,
                 truth=_BOXED_TRUTH, answer="the last \\boxed{} after any </think>, compared by math-verify")
@register_reward("math", truth=_BOXED_TRUTH,
                 answer="the last \\boxed{} (or \\fbox{}) after any </think> of the generated text (a multi-turn "
                        "trajectory's turns, not its tool replies), compared by math-verify; no box scores 0")
def math_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """1.0 when the last boxed answer after any </think> of the generated text equals `ground_truth`
    (math-verify), else 0.0."""
    pred = last_boxed(strip_thinking("\n".join(generated_turns(solution_str, extra_info))))
    return {"score": _verified(pred, ground_truth), "pred": pred}


def generated_turns(solution_str: str, extra_info: dict | None) -> list[str]:
    """The texts the model generated, one per turn: the trajectory's when the reward pool gave it
    (`extra_info["trajectory"]`, a `rl360.core.TrajectorySummary`: tool replies left out), else the response as
    one turn."""
    trajectory = (extra_info or {}).get("trajectory")
    if isinstance(trajectory, dict) and trajectory.get("turn_texts"):
        return [str(text) for text in trajectory["turn_texts"]]
    return [solution_str]


_STATED_ANSWER = ("the last \\boxed{} or a later \"Answer: X\" / \"the answer is X\" line after any </think>, "
                  "compared by math-verify; 0/1 (verl's math_dapo: -1/1)")


@register_reward("math", metric="prime_math", truth=_BOXED_TRUTH, answer=_STATED_ANSWER)
@register_reward(*NUMINA_SOURCES, exact=True, truth=_BOXED_TRUTH, answer=_STATED_ANSWER)
@register_reward("aime", truth="the final answer, usually an integer", answer=_STATED_ANSWER)
@register_reward("math", "math_dapo", "math_dapo_reasoning", exact=True, truth=_BOXED_TRUTH, answer=_STATED_ANSWER)
def stated_math_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """1.0 when the stated answer (`stated_answer`) equals `ground_truth` (math-verify), else 0.0."""
    pred = stated_answer(solution_str)
    return {"score": _verified(pred, ground_truth), "pred": pred}


def stated_answer(response: str) -> str | None:
    """The answer a response states after any </think>: the last \\boxed{}, or the value of a later
    "Answer: X" / "the answer is X" line (its first `$...$` if it has one, else the line without a final
    period or markdown bold), whichever comes last; None when there is neither."""
    text = strip_thinking(response)
    box_at = max(text.rfind(box) for box in _BOXES)
    lines = list(_STATED.finditer(text))
    if lines and lines[-1].start() > box_at:
        return _line_value(lines[-1].group(1))
    boxed = last_boxed(text) if box_at >= 0 else None
    if boxed is None and lines:  # an unclosed box after the last answer line
        return _line_value(lines[-1].group(1))
    return boxed


def _line_value(value: str) -> str:
    """The answer in the rest of an "Answer:" line."""
    if any(box in value for box in _BOXES):
        boxed = last_boxed(value)
        if boxed is not None:
            return boxed
    dollars = _DOLLARS.search(value)
    if dollars:
        return dollars.group(1).strip()
    return value.replace("**", "").strip().rstrip(".").strip()


def _verified(pred: str | None, ground_truth) -> float:
    """1.0 when math-verify finds `pred` equal to `ground_truth` within `TIMEOUT_S`, else 0.0."""
    if pred is None:
        return 0.0
    if not isinstance(ground_truth, (str, numbers.Real)) or isinstance(ground_truth, bool):
        raise ValueError(f"math: ground truth must be a string (or a number), got {type(ground_truth).__name__} "
                         f"{str(ground_truth)[:80]!r}")
    try:
        with time_limit(TIMEOUT_S):
            correct = is_equiv(pred, str(ground_truth))
    except MathTimeout:
        logger.warning("math-verify timed out after %g s on the answer %.200r; scored 0", TIMEOUT_S, pred)
        correct = False
    return 1.0 if correct else 0.0


def _as_boxed(answer: str) -> str:
    """`answer` wrapped as \\boxed{...} so math-verify's LaTeX extraction takes all of it; a ground truth
    that already carries a \\boxed{} is reduced to its content first."""
    answer = str(answer)
    inner = last_boxed(answer) if "\\boxed" in answer or "\\fbox" in answer else None
    return f"\\boxed{{{answer if inner is None else inner}}}"


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once that its timeouts are off; here that is deliberate (`time_limit` above)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())
