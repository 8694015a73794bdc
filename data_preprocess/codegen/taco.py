"""TACO (BAAI/TACO, likaixin/TACO-verified) -> codegen__taco.

Source fields: `question`, `starter_code`, `input_output` (JSON text: `{"inputs", "outputs"}` for stdin/stdout
tests, plus `"fn_name"` for function tests whose inputs are argument lists), `solutions` (JSON list of
reference programs), `source`, `difficulty`. Stdin/stdout tests give `{"inputs", "outputs"}`; function tests
give `{"functional": ...}` test code that calls the function (as `Solution().<fn_name>` when the starter code
defines `class Solution`). A problem without tests is left out; --max-tests keeps the tests with the
shortest inputs.

    python -m data_preprocess.codegen.taco --input taco-train.jsonl --out data --max-tests 8
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from data_preprocess.codegen.truth import code_prompt, functional_truth, method_call, stdin_stdout_truth
from data_preprocess.common import Example, RecordError, parse_literal, require, run_script, user_prompt


def convert(record: dict[str, Any], index: int, args: argparse.Namespace) -> Example | None:
    question, tests = require(record, "question", "input_output")
    tests = parse_literal(tests) if tests else {}
    starter = record.get("starter_code") or ""
    inputs, outputs = tests.get("inputs") or [], tests.get("outputs") or []
    if len(inputs) != len(outputs):
        raise RecordError(f"input_output has {len(inputs)} inputs but {len(outputs)} outputs")
    if tests.get("fn_name"):
        truth = functional_truth(method_call(tests["fn_name"], starter), list(zip(inputs, outputs)), args.max_tests)
    else:
        truth = stdin_stdout_truth(inputs, outputs, args.max_tests)
    if truth is None:
        return None
    solutions = parse_literal(record.get("solutions") or "[]")
    extra = {"source": str(record.get("source") or ""), "difficulty": str(record.get("difficulty") or ""),
             "reference": str(solutions[0]) if solutions else ""}
    return Example(user_prompt(code_prompt(question, starter)), truth, extra)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tests", type=int, default=None, help="keep at most this many tests per problem")


def main(argv: list[str] | None = None) -> Path:
    return run_script(convert, domain="codegen", name="taco", description=__doc__, argv=argv,
                      add_arguments=add_arguments)


if __name__ == "__main__":
    main()
