"""`codegen*`, and verl's `codecontests`, `apps`, `codeforces`, `taco`: run the response's code in the sandbox
against the ground truth's tests.

The solution is the last fenced code block (```python ... ``` or ``` ... ```) of the response after any
</think>; a response without one scores 0 (verl's prime_code also runs a response with no fence as code).
The ground truth is a JSON string (or the same as a dict), as in Reasoning360 and verl:

- `{"inputs": [...], "outputs": [...]}`: each input is fed on stdin to a fresh run of the solution, and
  its stdout is compared with the expected output (`outputs_match`: trailing whitespace per line and
  blank lines at the ends ignored; tokens that both parse as numbers match within 1e-6, absolute or
  relative). An input or output given as a list of lines is joined with newlines.
- `{"fn_name": "f", "inputs": [...], "outputs": [...]}` (verl's prime_code / APPS / TACO call-based tests):
  for each case a fresh run calls `f` (or the method `f` of `Solution()` when the code defines a class
  `Solution`, as LeetCode-style code does) with that input's arguments, and its return value is compared
  with the expected one (`call_results_match`). An input is a list of arguments, or a string holding one
  JSON value per line (one line per argument, as verl's data stores it); an output is a value or its JSON
  text, and a one-element list around it (APPS wraps every output so) is also accepted. The code runs with
  `typing`, `collections`, `heapq`, `bisect`, `itertools`, `functools`, `math`, `string` and `re` imported
  (and their names, `List`, `defaultdict`, ..., in scope), as the harnesses of LeetCode and verl have them.
- `{"functional": "<test code>"}`: the solution followed by the test code runs once; exit status 0
  passes.

Code runs in the local sandbox, or on a SandboxFusion-compatible server when RL360_SANDBOX_URL is set
(`rl360.rewards.remote_sandbox`).

Scoring is all-or-nothing (as Reasoning360; verl's prime_code gives the fraction of the first ten cases
passed when not all pass): 1.0 only when every case passes. Cases run in order and the first failure stops
the run, so `pass_fraction` in the extras is the fraction passed before it (a lower bound of the fraction a
full run would pass). Extras also say `passed`, `total`, and for a failure `failure` (wrong answer, timeout,
runtime error with the stderr tail, no code).
"""

from __future__ import annotations

import json
import math
import re

from rl360.rewards.extract import values_equal
from rl360.rewards.registry import register_reward
from rl360.rewards.remote_sandbox import run_python_code
from rl360.rewards.sandbox import SandboxLimits, SandboxResult

CASE_TIMEOUT_S = 5.0  # wall clock of one case (one run of the solution)
TOLERANCE = 1e-6
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+\-]*)[^\n]*\n(.*?)```", re.DOTALL)
_STDERR_TAIL = 300
RESULT_MARKER = "@@rl360-call-result@@ "  # starts the harness's line holding the JSON return value
_PRELUDE = ("from typing import *\nfrom collections import *\nfrom heapq import *\nfrom bisect import *\n"
            "from itertools import *\nfrom functools import *\nfrom math import *\n"
            "import typing, collections, heapq, bisect, itertools, functools, math, string, re\n")
_HARNESS = """\
import json, os, sys

def _main():
    arguments = json.loads(sys.stdin.read())
    namespace = {{"__name__": "solution"}}
    exec(compile({prelude!r}, "<prelude>", "exec"), namespace)
    exec(compile({source!r}, "solution.py", "exec"), namespace)
    owner = namespace.get("Solution")
    if isinstance(owner, type) and hasattr(owner, {fn_name!r}):
        function = getattr(owner(), {fn_name!r})
    elif {fn_name!r} in namespace:
        function = namespace[{fn_name!r}]
    else:
        sys.stderr.write("the code defines no function (or Solution method) named " + {fn_name!r} + "\\n")
        sys.exit(1)
    result = function(*arguments)
    sys.stdout.flush()
    try:
        line = json.dumps(result)
    except (TypeError, ValueError) as err:
        sys.stderr.write("the return value cannot be written as JSON: " + repr(err) + "\\n")
        sys.stderr.flush()
        os._exit(1)
    os.write(1, ("\\n" + {marker!r} + line + "\\n").encode())
    os._exit(0)

_main()
"""
_CODE_TRUTH = "JSON {\"inputs\": [...], \"outputs\": [...]} (stdin/stdout), optional \"fn_name\" (call-based)"
_CODE_ANSWER = ("the last fenced code block after any </think>, run in the sandbox; 1 only when every case passes "
                "(verl: fraction of the first 10)")


def extract_code(response: str) -> str | None:
    """The last fenced code block after any </think>, or None when there is none."""
    text = response.rsplit("</think>", 1)[-1]
    blocks = _FENCE.findall(text)
    return blocks[-1][1] if blocks else None


def outputs_match(actual: str, expected: str, tolerance: float = TOLERANCE) -> bool:
    """Whether stdout `actual` matches `expected`: same lines once trailing whitespace is stripped and
    blank lines at the ends dropped; within a line the same whitespace-separated tokens, numbers within
    `tolerance` (absolute or relative)."""
    got, want = _lines(actual), _lines(expected)
    if got == want:
        return True
    if len(got) != len(want):
        return False
    for got_line, want_line in zip(got, want):
        got_tokens, want_tokens = got_line.split(), want_line.split()
        if len(got_tokens) != len(want_tokens):
            return False
        if not all(_tokens_match(a, b, tolerance) for a, b in zip(got_tokens, want_tokens)):
            return False
    return True


@register_reward("codecontests", "apps", "codeforces", "taco", exact=True, truth=_CODE_TRUTH, answer=_CODE_ANSWER,
                 runs_code=True)
@register_reward("codegen", truth=_CODE_TRUTH + " or {\"functional\": test code}", answer=_CODE_ANSWER,
                 runs_code=True)
def codegen_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """1.0 when the extracted code passes every test of `ground_truth`, else 0.0; see the module doc."""
    code = extract_code(solution_str)
    truth = _truth(ground_truth)
    limits = SandboxLimits(timeout_s=CASE_TIMEOUT_S)
    if "functional" in truth:
        total = 1
    elif "inputs" in truth and "outputs" in truth:
        total = _case_count(truth)
    else:
        raise ValueError("codegen ground truth needs 'inputs' and 'outputs', or 'functional'; "
                         f"got keys {sorted(truth)}")
    if code is None:
        return _verdict(0, total, "no fenced code block in the response")
    if "functional" in truth:
        result = run_python_code(code + "\n\n" + truth["functional"], limits=limits)
        return _verdict(int(result.ok), total, None if result.ok else _why(result))
    fn_name = truth.get("fn_name")
    if fn_name not in (None, ""):
        return _call_cases(code, fn_name, truth, limits)
    for index, (stdin, expected) in enumerate(zip(truth["inputs"], truth["outputs"])):
        result = run_python_code(code, _text(stdin), limits)
        if not result.ok:
            return _verdict(index, total, f"case {index}: {_why(result)}")
        if not outputs_match(result.stdout, _text(expected)):
            return _verdict(index, total, f"case {index}: wrong answer")
    return _verdict(total, total, None)


def call_results_match(result, expected) -> bool:
    """Whether a call's return value (as JSON gives it back: tuples are lists) equals the expected output,
    numbers within 1e-6 relative; a one-element list around the expected value also counts."""
    if values_equal(result, expected):
        return True
    return isinstance(expected, list) and len(expected) == 1 and values_equal(result, expected[0])


def call_arguments(case_input, index: int) -> list:
    """A call-based case's arguments: a list as it is, or a string with one JSON value per line."""
    if isinstance(case_input, list):
        return case_input
    if isinstance(case_input, str):
        try:
            return [json.loads(line) for line in case_input.split("\n") if line.strip()]
        except ValueError as err:
            raise ValueError(f"codegen ground truth inputs[{index}]: a call-based input string must hold one "
                             f"JSON value per line ({err}): {case_input[:120]!r}") from None
    raise ValueError(f"codegen ground truth inputs[{index}]: a call-based input must be a list of arguments or "
                     f"a string of JSON lines, got {type(case_input).__name__}")


def call_expected(case_output):
    """A call-based case's expected return value: JSON text decoded (other text as it is), or the value."""
    if isinstance(case_output, str):
        try:
            return json.loads(case_output)
        except ValueError:
            return case_output
    return case_output


def call_harness(code: str, fn_name: str) -> str:
    """A script that runs `code`, calls `fn_name` with the JSON list of arguments on stdin, and writes the
    return value as JSON on a last stdout line starting with `RESULT_MARKER`."""
    if not isinstance(fn_name, str) or not fn_name.isidentifier():
        raise ValueError(f"codegen ground truth 'fn_name' must be a Python identifier, got {fn_name!r}")
    return _HARNESS.format(prelude=_PRELUDE, source=code, fn_name=fn_name, marker=RESULT_MARKER)


def _call_cases(code: str, fn_name: str, truth: dict, limits: SandboxLimits) -> dict:
    total = len(truth["inputs"])
    cases = [(call_arguments(case_input, index), call_expected(case_output))
             for index, (case_input, case_output) in enumerate(zip(truth["inputs"], truth["outputs"]))]
    harness = call_harness(code, fn_name)
    for index, (arguments, expected) in enumerate(cases):
        result = run_python_code(harness, json.dumps(arguments), limits)
        if not result.ok:
            return _verdict(index, total, f"case {index}: {_why(result)}")
        returned = _returned(result.stdout)
        if returned is _NO_RESULT:
            return _verdict(index, total, f"case {index}: no return value was reported")
        if not call_results_match(returned, expected):
            return _verdict(index, total, f"case {index}: wrong answer")
    return _verdict(total, total, None)


_NO_RESULT = object()


def _returned(stdout: str):
    """The JSON value on the harness's last result line, or `_NO_RESULT`."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            try:
                return json.loads(line[len(RESULT_MARKER):])
            except ValueError:
                return _NO_RESULT
    return _NO_RESULT


def _truth(ground_truth) -> dict:
    """The test cases as a dict (JSON text or a dict); `ValueError` naming what is wrong."""
    if isinstance(ground_truth, str):
        try:
            ground_truth = json.loads(ground_truth)
        except ValueError as err:
            raise ValueError(f"codegen ground truth is not JSON ({err}): {ground_truth[:120]!r}") from None
    if not isinstance(ground_truth, dict):
        raise ValueError(f"codegen ground truth must be a JSON object, got {type(ground_truth).__name__}")
    return _as_python(ground_truth)


def _as_python(value):
    """`value` with numpy arrays and scalars (as pandas reads list columns) turned into lists and numbers."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, dict):
        return {key: _as_python(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_python(item) for item in value]
    return value


def _case_count(truth: dict) -> int:
    inputs, outputs = truth["inputs"], truth["outputs"]
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise ValueError(f"codegen ground truth 'inputs' and 'outputs' must be lists, got "
                         f"{type(inputs).__name__} and {type(outputs).__name__}")
    if len(inputs) != len(outputs):
        raise ValueError(f"codegen ground truth has {len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise ValueError("codegen ground truth has no test cases")
    return len(inputs)


def _verdict(passed: int, total: int, failure: str | None) -> dict:
    result = {"score": float(passed == total and total > 0), "passed": passed, "total": total,
              "pass_fraction": passed / total if total else 0.0}
    if failure is not None:
        result["failure"] = failure
    return result


def _why(result: SandboxResult) -> str:
    if result.error:
        return result.error
    if result.timed_out:
        return "timeout"
    if result.memory_exceeded:
        return "memory over the limit (all its processes together)"
    if result.output_truncated:
        return "output over the limit"
    tail = result.stderr.strip()[-_STDERR_TAIL:]
    how = f"killed by {result.killed_by_signal}" if result.killed_by_signal else f"exit code {result.returncode}"
    return f"runtime error ({how})" + (f": {tail}" if tail else "")


def _text(value: object) -> str:
    """A case's input or output as text (lists of lines are joined, other JSON values printed)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return "\n".join(value)
    return json.dumps(value)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def _tokens_match(got: str, want: str, tolerance: float) -> bool:
    if got == want:
        return True
    try:
        a, b = float(got), float(want)
    except ValueError:
        return False
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=tolerance, abs_tol=tolerance)
