"""Code simulation rewards (Reasoning360 names).

- `simulation__codeio*`: truth `{"output": v}` or `{"input": v}` (Reasoning360's brace-less fragment
  `"input": {...}` too); the response's last JSON object after any </think> (or a Python dict literal)
  must hold the same key with an equal value: numbers within 1e-6 relative, booleans only as booleans,
  strings exactly, lists in order, dicts by key. An input answer may also be the bare dict of
  arguments. Only the recorded input scores: the truth does not carry the program, so another input that
  gives the same output scores 0.
- `simulation__cruxeval*`, two ground-truth formats. Output prediction is `simulation__cruxeval_o`, `-o`,
  or `extra_info["task"] == "output"` (the default; `extra_info["dataset"] == "cruxeval-i"` means input);
  input prediction is `simulation__cruxeval_i`, `-i`, or task "input".
  - Ours (`data_preprocess/simulation/cruxeval.py`): truth `{"code", "input", "output"}`; the answer is the
    last <answer> … </answer>. Output: the answer as a Python literal equals `output` (`==`, as CRUXEval's
    own `assert f(x) == y`), else the two texts are equal once runs of whitespace are collapsed. Input:
    the answer must be an argument list of Python literals (`'hi', 3`, or `f('hi', 3)`), parsed with `ast`
    and never run here; equal to the recorded input it scores 1 at once, otherwise `f` runs on it in the
    code sandbox (`rl360.rewards.sandbox`, or the server at RL360_SANDBOX_URL) and it scores 1 when
    `f(answer) == output`.
  - Reasoning360's: truth `json.dumps({"functional": code})`; its prompts ask for the completed assertion
    in a ```python block, and `extra_info` holds `reference` (the output) and `original_prompt` (with
    `assert f(<input>) == ??` or `assert f(??) == <output>`). The answer is the last fenced block after
    any </think> that holds an `assert` (```python, ```py or a bare ```; at most 20,000 characters), or,
    when no block holds one, the whole text after any </think> if it parses as Python by itself (a bare
    `assert f(...) == ...` line; prose around it does not parse, as Reasoning360 runs that text too),
    which must hold exactly one top-level `assert f(args) == literal` (or `literal == f(args)`): a call of
    a function the truth's code defines, on Python literals, compared with a literal. Anything else scores
    0: no block, `assert True`, `assert f(x) == f(x)`, a call on names or expressions, an assert that is
    not one `==`. Other code in the block (the function restated) is never run. The task pins the
    assertion (Reasoning360 runs whatever the block holds, so `assert True` passes there): an output
    prediction must call f on the prompt's input (when `original_prompt` shows it) and assert the
    `reference` output (when given); an input prediction must assert the `reference` output (else the
    prompt's), and may use any input. A row that pins neither, or an input prediction without its output,
    is a `ValueError` naming the missing extra_info key. Then the truth's code runs in the sandbox with the
    assertion rebuilt from the parsed literals (the response's text is never executed) and scores 1 when
    `f(args) == literal`.
- `simulation__arcagi*`, `simulation__barc*` (Reasoning360's names; some of its versions and data files say
  `logic__arcagi*`, `logic__barc*`, which score the same): no preprocessing script ships here, so this is
  the format to write: the truth is a grid, a JSON list of lists of ints such as `[[0, 1], [1, 0]]`. The
  answer is the last such grid in the last <answer> tag (else after any </think>), or rows of integers one
  per line inside the tag; it must equal the truth cell for cell.
"""

from __future__ import annotations

import ast
import re
import secrets
from typing import NamedTuple

from rl360.rewards.extract import last_answer_tag, last_json_object, parse_truth, strip_fence, values_equal
from rl360.rewards.math import strip_thinking
from rl360.rewards.registry import register_reward
from rl360.rewards.remote_sandbox import run_python_code
from rl360.rewards.sandbox import SandboxLimits

CRUXEVAL_TIMEOUT_S = 5.0
MAX_GRID_TRIES = 200  # "[[ … ]]" spans parsed in search of an ARC grid, so odd text costs little
_LITERAL_ERRORS = (ValueError, TypeError, SyntaxError, MemoryError, RecursionError)


# ----- CodeI/O -------------------------------------------------------------------------------------------


@register_reward("simulation__codeio", truth="JSON {\"output\": v} or {\"input\": v} (or Reasoning360's fragment)",
                 answer="the last JSON object (or Python dict) after any </think> holding that key")
def codeio_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """1.0 when the response's last JSON object holds the predicted input or output (see the module doc)."""
    key, want = _codeio_truth(ground_truth, (extra_info or {}).get("predict"))
    answer = last_json_object(strip_thinking(solution_str))
    if not isinstance(answer, dict):
        return {"score": 0.0}
    if key in answer:
        given = answer[key]
    elif key == "input" and isinstance(want, dict) and answer.keys() == want.keys():
        given = answer  # the arguments without the {"input": ...} wrapper
    else:
        return {"score": 0.0}
    return {"score": float(values_equal(given, want))}


def _codeio_truth(ground_truth, predict: str | None) -> tuple[str, object]:
    """("input" or "output", the value); the key is `predict` when the truth holds both."""
    if isinstance(ground_truth, str) and ground_truth.lstrip().startswith('"'):
        ground_truth = "{" + ground_truth + "}"  # Reasoning360's '"output": ...' fragments
    truth = parse_truth(ground_truth, "simulation__codeio")
    keys = [key for key in ("input", "output") if isinstance(truth, dict) and key in truth]
    if predict in keys:
        keys = [predict]
    if len(keys) != 1:
        raise ValueError(f"simulation__codeio: ground truth must be {{'output': ...}} or {{'input': ...}}, got "
                         f"{str(ground_truth)[:120]!r}")
    return keys[0], truth[keys[0]]


# ----- CRUXEval ------------------------------------------------------------------------------------------


_CRUX_TRUTH = ("JSON {\"code\", \"input\", \"output\"}, or Reasoning360's {\"functional\": code} "
               "(+ extra_info reference)")
_CRUX_ANSWER = ("a Python literal in the last <answer>, or (functional) one ```python assert f(literals) == literal "
                "block (or that bare assert line), run in the sandbox")
_DATASET_TASKS = {"cruxeval-o": "output", "cruxeval_o": "output", "cruxeval-i": "input", "cruxeval_i": "input"}


@register_reward("simulation__cruxeval", truth=_CRUX_TRUTH, answer=_CRUX_ANSWER, runs_code=True)
def cruxeval_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """Output prediction, or input prediction when `extra_info["task"] == "input"` (see the module doc)."""
    extra = extra_info or {}
    task = extra.get("task") or _DATASET_TASKS.get(str(extra.get("dataset", ""))) or "output"
    if task not in ("output", "input"):
        raise ValueError(f"simulation__cruxeval: extra_info task must be 'output' or 'input', got {task!r}")
    return _cruxeval(solution_str, ground_truth, task, extra)


@register_reward("simulation__cruxeval_o", "simulation__cruxeval-o", truth=_CRUX_TRUTH, answer=_CRUX_ANSWER,
                 runs_code=True)
def cruxeval_output_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """CRUXEval-O: the answer is the function's return value."""
    return _cruxeval(solution_str, ground_truth, "output", extra_info or {})


@register_reward("simulation__cruxeval_i", "simulation__cruxeval-i", truth=_CRUX_TRUTH, answer=_CRUX_ANSWER,
                 runs_code=True)
def cruxeval_input_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """CRUXEval-I: the answer is an argument list for which the function returns the output."""
    return _cruxeval(solution_str, ground_truth, "input", extra_info or {})


def _cruxeval(solution_str: str, ground_truth, task: str, extra_info: dict) -> dict:
    truth = parse_truth(ground_truth, "simulation__cruxeval")
    if isinstance(truth, dict) and "functional" in truth:
        return _cruxeval_functional(solution_str, truth["functional"], task, extra_info)
    if not isinstance(truth, dict) or not {"code", "input", "output"} <= truth.keys():
        raise ValueError(f"simulation__cruxeval: ground truth needs code, input and output (or Reasoning360's "
                         f"{{'functional': code}}), got {str(ground_truth)[:120]!r}")
    answer = last_answer_tag(solution_str)
    if not answer:
        return {"score": 0.0, "pred": None, "failure": "no <answer>"}
    answer = strip_fence(answer)
    if task == "output":
        return {"score": float(_literals_equal(answer, str(truth["output"]))), "pred": answer}
    return {"pred": answer, **_check_input(answer, truth)}


def _literals_equal(answer: str, expected: str) -> bool:
    try:
        return ast.literal_eval(answer) == ast.literal_eval(expected)
    except _LITERAL_ERRORS:
        return " ".join(answer.split()) == " ".join(expected.split())


def call_arguments(text: str) -> tuple[list[str], dict[str, str]] | None:
    """The source texts of the positional and keyword arguments in "'hi', 3" or "f('hi', k=3)", when every
    one is a Python literal; None otherwise. The text is parsed, never run."""
    call_text = text if re.match(r"f\s*\(", text) else f"f({text})"
    try:
        call = ast.parse(call_text, mode="eval").body
    except _LITERAL_ERRORS:
        return None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "f"):
        return None
    if any(isinstance(node, ast.Starred) for node in call.args) or any(kw.arg is None for kw in call.keywords):
        return None
    nodes = list(call.args) + [kw.value for kw in call.keywords]
    try:
        for node in nodes:
            ast.literal_eval(node)
    except _LITERAL_ERRORS:
        return None
    sources = [ast.get_source_segment(call_text, node) for node in nodes]
    positional = sources[:len(call.args)]
    keywords = {kw.arg: source for kw, source in zip(call.keywords, sources[len(call.args):])}
    return positional, keywords


def _check_input(answer: str, truth: dict) -> dict:
    arguments = call_arguments(answer)
    if arguments is None:
        return {"score": 0.0, "failure": "the answer is not an argument list of Python literals"}
    if _same_arguments(arguments, str(truth["input"])):
        return {"score": 1.0}
    positional, keywords = arguments
    return _run_call(truth["code"], "f", positional, keywords, f"({truth['output']})")


def _run_call(code: str, function: str, positional: list[str], keywords: dict[str, str], expected: str) -> dict:
    """Score 1 when `function(*positional, **keywords) == expected` holds in the sandbox after `code`. The
    arguments are literal sources, read there with `ast.literal_eval`; `expected` is an expression."""
    token = secrets.token_hex(8)
    program = (f"{code}\n\n"
               "import ast as _ast\n"
               f"_args = [_ast.literal_eval(_s) for _s in {positional!r}]\n"
               f"_kwargs = {{_k: _ast.literal_eval(_s) for _k, _s in {keywords!r}.items()}}\n"
               f"print({token!r} if {function}(*_args, **_kwargs) == {expected} else 'wrong')\n")
    result = run_python_code(program, limits=SandboxLimits(timeout_s=CRUXEVAL_TIMEOUT_S))
    if result.ok and token in result.stdout.split():
        return {"score": 1.0}
    return {"score": 0.0, "failure": "wrong output" if result.ok else "error or timeout running f"}


def _same_arguments(arguments: tuple[list[str], dict[str, str]], truth_input: str) -> bool:
    """Whether `arguments` hold the same literal values as the recorded input."""
    recorded = call_arguments(truth_input)
    if recorded is None:
        return False
    (got, got_kw), (want, want_kw) = arguments, recorded
    values = lambda sources: [ast.literal_eval(source) for source in sources]
    return (len(got) == len(want) and got_kw.keys() == want_kw.keys() and values(got) == values(want)
            and all(ast.literal_eval(got_kw[k]) == ast.literal_eval(want_kw[k]) for k in got_kw))


# ----- CRUXEval as Reasoning360 writes it: {"functional": code}, answered by an assertion ----------------

MAX_ASSERTION_BLOCK_CHARS = 20_000  # a longer block is not parsed (compiling it costs seconds); it scores 0
_PYTHON_FENCE_TAGS = ("", "python", "python3", "py")
_PROMPT_INPUT = re.compile(r"^[ \t]*assert[ \t]+(f[ \t]*\(.*\))[ \t]*==[ \t]*\?\?[ \t]*$", re.MULTILINE)
_PROMPT_OUTPUT = re.compile(r"^[ \t]*assert[ \t]+f[ \t]*\([ \t]*\?\?[ \t]*\)[ \t]*==[ \t]*(.+?)[ \t]*$", re.MULTILINE)


class Assertion(NamedTuple):
    """`assert function(*positional, **keywords) == expected`, every part the source of a Python literal."""

    function: str
    positional: list[str]
    keywords: dict[str, str]
    expected: str


def _cruxeval_functional(solution_str: str, code, task: str, extra_info: dict) -> dict:
    if not isinstance(code, str) or not code.strip():
        raise ValueError(f"simulation__cruxeval: ground truth 'functional' must be the function's code, got "
                         f"{str(code)[:120]!r}")
    functions = defined_functions(code)
    known_input, known_output = _task_pins(extra_info)
    if task == "input" and known_output is None:
        raise ValueError("simulation__cruxeval: an input prediction with a {'functional': code} ground truth needs "
                         "extra_info['reference'] (the output f must return) or an original_prompt showing "
                         "'assert f(??) == <output>'")
    if known_input is None and known_output is None:
        raise ValueError("simulation__cruxeval: an output prediction with a {'functional': code} ground truth needs "
                         "extra_info['original_prompt'] showing 'assert f(<input>) == ??' or "
                         "extra_info['reference'] (the output)")
    assertion = last_assertion(solution_str, functions)
    if assertion is None:
        return {"score": 0.0, "pred": None,
                "failure": "no fenced block (nor a bare Python reply) with one assert f(literals) == literal for "
                           "a function of the code"}
    pred = _assertion_text(assertion)
    arguments = (assertion.positional, assertion.keywords)
    if task == "output" and known_input is not None and not _same_arguments(arguments, known_input):
        return {"score": 0.0, "pred": pred, "failure": "the assertion calls f on another input than the task's"}
    if known_output is not None and not _same_literal(assertion.expected, known_output):
        return {"score": 0.0, "pred": pred, "failure": "the assertion's output is not the task's"}
    expected = f"_ast.literal_eval({assertion.expected!r})"
    return {"pred": pred, **_run_call(code, assertion.function, assertion.positional, assertion.keywords, expected)}


def defined_functions(code: str) -> set[str]:
    """Names of the functions `code` defines at its top level; `ValueError` when it defines none or does not
    parse."""
    try:
        tree = ast.parse(code)
    except _LITERAL_ERRORS as error:
        raise ValueError(f"simulation__cruxeval: ground truth 'functional' is not Python ({error}): "
                         f"{code[:120]!r}") from None
    names = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if not names:
        raise ValueError(f"simulation__cruxeval: ground truth 'functional' defines no function: {code[:120]!r}")
    return names


def _task_pins(extra_info: dict) -> tuple[str | None, str | None]:
    """(the call the task's input is, e.g. "f('ab', 2)"; the output's literal source), each None when
    `extra_info` does not say. `ValueError` when `reference` is there but is no Python literal."""
    prompt = extra_info.get("original_prompt")
    prompt = prompt if isinstance(prompt, str) else ""
    inputs, outputs = _PROMPT_INPUT.findall(prompt), _PROMPT_OUTPUT.findall(prompt)
    known_input = inputs[-1] if inputs and call_arguments(inputs[-1]) is not None else None
    reference = extra_info.get("reference")
    if reference is not None:
        known_output = reference if isinstance(reference, str) else repr(reference)
        if not _is_literal(known_output):
            raise ValueError(f"simulation__cruxeval: extra_info['reference'] is not a Python literal: "
                             f"{known_output[:120]!r}")
    else:
        known_output = outputs[-1] if outputs and _is_literal(outputs[-1]) else None
    return known_input, known_output


def last_assertion(response: str, functions: set[str]) -> Assertion | None:
    """The assertion of the last fenced block (after any </think>) that holds an `assert`, when that block
    holds exactly one top-level assert of the accepted form (see the module doc); parsed, never run."""
    text = strip_thinking(response)
    blocks = [block for block in python_blocks(text) if "assert" in block]
    if not blocks:  # no fence: the whole text, when it is Python by itself (a bare `assert f(...) == ...`)
        return _bare_assertion(text.strip(), functions)
    if len(blocks[-1]) > MAX_ASSERTION_BLOCK_CHARS:
        return None
    asserts = _top_level_asserts(blocks[-1])
    return _literal_assertion(*asserts[0], functions) if len(asserts) == 1 else None


def _bare_assertion(text: str, functions: set[str]) -> Assertion | None:
    """The one top-level assert of `text` when the whole of it parses as Python (as Reasoning360 runs an
    unfenced reply after the function's code, so prose around the assert fails there)."""
    if "assert" not in text or len(text) > MAX_ASSERTION_BLOCK_CHARS:
        return None
    try:
        tree = ast.parse(text)
    except _LITERAL_ERRORS:
        return None
    asserts = [node for node in tree.body if isinstance(node, ast.Assert)]
    return _literal_assertion(asserts[0], text, functions) if len(asserts) == 1 else None


def python_blocks(text: str) -> list[str]:
    """The contents of the closed ``` fences of `text`, in order, whose tag is python, python3, py or none."""
    pieces = text.split("```")
    blocks = []
    for inside in pieces[1:-1:2]:  # between an opening fence and its closing one
        tag, newline, content = inside.partition("\n")
        if newline and tag.strip().lower() in _PYTHON_FENCE_TAGS:
            blocks.append(content)
    return blocks


def _top_level_asserts(block: str) -> list[tuple[ast.Assert, str]]:
    """(node, source) of each top-level assert in `block`; when the block does not parse as a whole (a
    restated function with a typo), of each line that is an assert statement by itself."""
    try:
        tree = ast.parse(block)
    except _LITERAL_ERRORS:
        found = []
        for line in block.splitlines():
            if line.strip().startswith("assert"):
                try:
                    found += [(node, line.strip()) for node in ast.parse(line.strip()).body]
                except _LITERAL_ERRORS:
                    continue
        return [(node, source) for node, source in found if isinstance(node, ast.Assert)]
    return [(node, block) for node in tree.body if isinstance(node, ast.Assert)]


def _literal_assertion(node: ast.Assert, source: str, functions: set[str]) -> Assertion | None:
    """`node` as an `Assertion`, when it is `assert fn(literals) == literal` (either side) with no message."""
    test = node.test
    if node.msg is not None or not isinstance(test, ast.Compare) or len(test.ops) != 1 \
            or not isinstance(test.ops[0], ast.Eq):
        return None
    left, right = test.left, test.comparators[0]
    call, expected = (left, right) if isinstance(left, ast.Call) else (right, left)
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in functions):
        return None
    if any(isinstance(arg, ast.Starred) for arg in call.args) or any(kw.arg is None for kw in call.keywords):
        return None
    nodes = [*call.args, *(kw.value for kw in call.keywords), expected]
    sources = [ast.get_source_segment(source, part) for part in nodes]
    if any(text is None or not _is_literal(text) for text in sources):
        return None
    positional = sources[:len(call.args)]
    keywords = {kw.arg: text for kw, text in zip(call.keywords, sources[len(call.args):-1])}
    return Assertion(call.func.id, positional, keywords, sources[-1])


def _is_literal(text: str) -> bool:
    try:
        ast.literal_eval(text.strip())
    except _LITERAL_ERRORS:
        return False
    return True


def _same_literal(a: str, b: str) -> bool:
    """Whether two literal sources hold equal values (`==`, as CRUXEval's assertion compares)."""
    try:
        return ast.literal_eval(a.strip()) == ast.literal_eval(b.strip())
    except _LITERAL_ERRORS:
        return False


def _assertion_text(assertion: Assertion) -> str:
    arguments = [*assertion.positional, *(f"{key}={value}" for key, value in assertion.keywords.items())]
    return f"assert {assertion.function}({', '.join(arguments)}) == {assertion.expected}"


# ----- ARC-AGI -------------------------------------------------------------------------------------------


@register_reward("simulation__arcagi", "simulation__barc", "logic__arcagi", "logic__barc",
                 truth="a grid: JSON list of lists of ints",
                 answer="the last grid in the last <answer> (else after </think>), or rows of ints in the tag")
def arcagi_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """1.0 when the answer grid equals the truth cell for cell (see the module doc)."""
    truth = parse_truth(ground_truth, "simulation__arcagi")
    if not _is_grid(truth):
        raise ValueError(f"simulation__arcagi: ground truth must be a list of lists of ints, got "
                         f"{str(ground_truth)[:120]!r}")
    tagged = last_answer_tag(solution_str)
    grid = _last_grid(tagged if tagged is not None else strip_thinking(solution_str))
    if grid is None and tagged:
        grid = _rows_of_ints(tagged)
    return {"score": float(grid == truth)}


def _is_grid(value) -> bool:
    return (isinstance(value, list) and bool(value) and all(isinstance(row, list) and row for row in value)
            and all(isinstance(cell, int) and not isinstance(cell, bool) for row in value for cell in row))


def _last_grid(text: str) -> list | None:
    """The last "[[ … ]]" of `text` that is a grid literal (at most `MAX_GRID_TRIES` spans are parsed)."""
    tries, end = 0, len(text)
    while (end := text.rfind("]]", 0, end)) >= 0:
        start = text.rfind("[[", 0, end)
        while start >= 0 and tries < MAX_GRID_TRIES:
            tries += 1
            try:
                value = ast.literal_eval(text[start:end + 2])
            except _LITERAL_ERRORS:
                value = None
            if _is_grid(value):
                return value
            start = text.rfind("[[", 0, start)
        if tries >= MAX_GRID_TRIES:
            return None
    return None


def _rows_of_ints(text: str) -> list | None:
    """A grid written as lines of integers separated by spaces or commas ("0 1\\n1 0")."""
    rows = [line.replace(",", " ").split() for line in text.strip().splitlines() if line.strip()]
    if not rows or not all(cell.lstrip("-").isdigit() for row in rows for cell in row):
        return None
    return [[int(cell) for cell in row] for row in rows]
