"""PrimeIntellect coding problems -> codegen__primeintellect.

Two source layouts are read:
- DeepCoder's primeintellect subset (agentica-org/DeepCoder-Preview-Dataset): `problem`, `tests` (JSON list of
  `{"type": "stdin_stdout" | "function_call", "input", "output", "fn_name"}`), `solutions`;
- PrimeIntellect/verifiable-coding-problems: `prompt`, `verification_info` (JSON with `test_cases` of the same
  form and `language`), `gold_standard_solution`, `problem_id`.

stdin_stdout tests give `{"inputs", "outputs"}`; function_call tests give `{"functional": ...}` test code that
calls `fn_name` with each input's arguments. Problems for another language than Python, and problems without
tests, are left out.

    python -m data_preprocess.codegen.primeintellect --input primeintellect.parquet --out data
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from data_preprocess.codegen.truth import code_prompt, functional_truth, stdin_stdout_truth
from data_preprocess.common import Example, RecordError, parse_literal, run_script, user_prompt


def problem_and_tests(record: dict[str, Any]) -> tuple[str, list[dict[str, Any]], str] | None:
    """(problem text, test cases, reference solution), or None for a problem in another language."""
    if record.get("problem") is not None and record.get("tests") is not None:
        solutions = parse_literal(record.get("solutions") or "[]")
        return record["problem"], parse_literal(record["tests"]), str(solutions[0]) if solutions else ""
    if record.get("prompt") is not None and record.get("verification_info") is not None:
        info = parse_literal(record["verification_info"])
        if info.get("language", "python").lower() not in ("python", "python3"):
            return None
        return record["prompt"], info.get("test_cases") or [], str(record.get("gold_standard_solution") or "")
    raise RecordError(f"expected fields problem+tests or prompt+verification_info; the record has {sorted(record)}")


def convert(record: dict[str, Any], index: int, args: argparse.Namespace) -> Example | None:
    found = problem_and_tests(record)
    if found is None:
        return None
    problem, tests, reference = found
    kinds = {test.get("type") for test in tests}
    if kinds == {"function_call"}:
        fn_names = {test.get("fn_name") for test in tests}
        if len(fn_names) != 1 or None in fn_names:
            raise RecordError(f"function_call tests must share one fn_name, got {sorted(map(str, fn_names))}")
        truth = functional_truth(fn_names.pop(), [(test["input"], test["output"]) for test in tests],
                                 args.max_tests)
    elif kinds == {"stdin_stdout"}:
        truth = stdin_stdout_truth([t["input"] for t in tests], [t["output"] for t in tests], args.max_tests)
    elif not tests:
        return None
    else:
        raise RecordError(f"unsupported or mixed test types {sorted(map(str, kinds))}")
    if truth is None:
        return None
    extra = {"problem_id": str(record.get("problem_id") or ""), "reference": reference}
    return Example(user_prompt(code_prompt(problem)), truth, extra)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tests", type=int, default=None, help="keep at most this many tests per problem")


def main(argv: list[str] | None = None) -> Path:
    return run_script(convert, domain="codegen", name="primeintellect", description=__doc__, argv=argv,
                      add_arguments=add_arguments)


if __name__ == "__main__":
    main()
