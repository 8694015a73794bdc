"""Codegen prompts and ground truths shared by the codegen scripts.

A ground truth is JSON text, either `{"inputs": [...], "outputs": [...]}` (each input fed on stdin, the
output compared with stdout) or `{"functional": "<test code>"}` (run after the solution; it passes when it
raises nothing).
"""

from __future__ import annotations

import json
from typing import Any

from data_preprocess.common import CODE_BLOCK

_STARTER = "Use this starter code (complete it; keep its names and signatures):"


def code_prompt(question: str, starter_code: str | None = None, note: str | None = None) -> str:
    """The task, the starter code when there is one, an optional note, and the code-block instruction."""
    parts = [question.strip()]
    if starter_code and starter_code.strip():
        parts.append(f"{_STARTER}\n```python\n{starter_code.strip()}\n```")
    if note:
        parts.append(note)
    parts.append(CODE_BLOCK)
    return "\n\n".join(parts)


def _as_text(value: Any) -> str:
    """A stdin/stdout value as text: a list of lines is joined with newlines; Windows newlines become \\n."""
    text = "\n".join(str(line) for line in value) if isinstance(value, list) else str(value)
    return text.replace("\r\n", "\n")


def stdin_stdout_truth(inputs: list[Any], outputs: list[Any], max_tests: int | None = None) -> str | None:
    """`{"inputs", "outputs"}` JSON of the tests (the `max_tests` with the shortest inputs when given),
    or None when there are no tests."""
    if len(inputs) != len(outputs):
        raise ValueError(f"{len(inputs)} test inputs but {len(outputs)} outputs")
    pairs = [(_as_text(stdin), _as_text(stdout)) for stdin, stdout in zip(inputs, outputs)]
    if max_tests is not None:
        pairs = sorted(pairs, key=lambda pair: len(pair[0]))[:max_tests]
    if not pairs:
        return None
    return json.dumps({"inputs": [stdin for stdin, _ in pairs], "outputs": [stdout for _, stdout in pairs]})


# The checker that functional tests run; it compares lists elementwise, floats with a tolerance, and a
# result against a one-element list of it (TACO and PrimeIntellect wrap some expected values so).
_CHECKER = '''import json as _json
import math as _math


def _same(got, want):
    if isinstance(got, tuple):
        got = list(got)
    if isinstance(got, float) or isinstance(want, float):
        try:
            return _math.isclose(float(got), float(want), rel_tol=1e-6, abs_tol=1e-6)
        except (TypeError, ValueError):
            return False
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    return got == want


def _check(call, cases):
    for number, (args, want) in enumerate(cases):
        got = call(*args)
        ok = _same(got, want) or (isinstance(want, list) and len(want) == 1 and _same(got, want[0]))
        assert ok, f"test {number}: {call.__name__}(*{args!r}) returned {got!r}, expected {want!r}"
'''


def functional_truth(call: str, cases: list[tuple[list[Any], Any]], max_tests: int | None = None) -> str | None:
    """`{"functional"}` JSON whose test code calls `call(*args)` (e.g. "add" or "Solution().twoSum") on each
    case's arguments and asserts the expected value; None when there are no cases."""
    cases = [(list(args) if isinstance(args, list | tuple) else [args], want) for args, want in cases]
    if max_tests is not None:
        cases = sorted(cases, key=lambda case: len(json.dumps(case[0])))[:max_tests]
    if not cases:
        return None
    encoded = json.dumps(json.dumps(cases))  # a Python string literal holding the JSON of the cases
    return json.dumps({"functional": f"{_CHECKER}\n_check({call}, _json.loads({encoded}))\n"})


def method_call(fn_name: str, starter_code: str | None) -> str:
    """How tests call `fn_name`: as a method of a fresh `Solution()` when the starter code defines that class."""
    if starter_code and "class Solution" in starter_code:
        return f"Solution().{fn_name}"
    return fn_name
