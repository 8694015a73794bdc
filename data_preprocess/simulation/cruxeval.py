"""CRUXEval (cruxeval-org/cruxeval) -> simulation__cruxeval_o (output prediction) or simulation__cruxeval_i
(input prediction, --task input).

Source fields: `code` (a Python function `f`), `input` (the arguments as Python source, e.g. "'hi', 3"),
`output` (the return value as a Python literal), `id`. The prompt shows the function and the assertion with
`??` in place of the output (or the input) and asks for the missing Python literal inside
<answer> … </answer>. The ground truth is JSON `{"code", "input", "output"}`: an output answer is compared
with `output` as a Python value; an input answer is checked by running `f` on it and comparing with `output`.

    python -m data_preprocess.simulation.cruxeval --input cruxeval.jsonl --out data --split test --task output
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from data_preprocess.common import Example, answer_tags, require, run_script, user_prompt

ASK = {
    "output": ("Execute the function step by step on the given input and replace ?? with the value it returns. "
               "Inside the tags give only that value, as a Python literal (no expressions or function calls)."),
    "input": ("Find an input such that executing the function on it returns the given output, and replace ?? "
              "with it. Inside the tags give only the argument list, as Python literals (e.g. 'hi', 3)."),
}


def convert(record: dict[str, Any], index: int, args: argparse.Namespace) -> Example:
    code, arguments, output = require(record, "code", "input", "output")
    assertion = (f"assert f({arguments}) == ??" if args.task == "output" else f"assert f(??) == {output}")
    example = "'bhihia'" if args.task == "output" else "'hi', 3"
    prompt = (f"```python\n{code.strip()}\n{assertion}\n```\n\n{ASK[args.task]} {answer_tags(example)}")
    truth = {"code": code, "input": str(arguments), "output": str(output)}
    return Example(user_prompt(prompt), truth, {"id": str(record.get("id", index)), "task": args.task})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", choices=["output", "input"], default="output",
                        help="predict the output (cruxeval_o) or an input (cruxeval_i)")


def main(argv: list[str] | None = None) -> Path:
    return run_script(convert, domain="simulation", name="cruxeval_o", description=__doc__, argv=argv,
                      add_arguments=add_arguments, data_source_name=lambda args: f"cruxeval_{args.task[0]}")


if __name__ == "__main__":
    main()
