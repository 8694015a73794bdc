"""CodeI/O (hkust-nlp/CodeIO-PyEdu-Reasoning-Raw) -> simulation__codeio.

Source fields: `problem_description`, `io_requirements`, `refcode` (a reference program) and `ios` (a list of
`{"input", "output"}` pairs; the first is used) — or `input` and `output` directly. Each record asks either
for the output given the input or for a feasible input given the output (--predict; "random" picks per record,
seeded by --seed). The ground truth is a JSON object `{"output": ...}` or `{"input": ...}`, compared with the
last JSON object of the response, which the prompt asks for.

    python -m data_preprocess.simulation.codeio --input codeio.jsonl --out data
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from data_preprocess.common import Example, RecordError, record_rng, require, run_script, user_prompt

ASK = {
    "output": ("Predict the output for the given input without writing or running any code. End your response "
               'with the answer as a JSON object {"output": <your output>}, where <your output> strictly matches '
               "the output requirement above."),
    "input": ("Predict a feasible input that produces the given output, without writing or running any code. End "
              'your response with the answer as a JSON object {"input": <your input>}, where <your input> is a '
              "dictionary whose keys are exactly the input variables' names above."),
}


def first_io(record: dict[str, Any]) -> tuple[Any, Any]:
    if record.get("ios"):
        io = record["ios"][0]
        return require(io, "input", "output")
    if "input" in record and "output" in record:
        return record["input"], record["output"]
    raise RecordError(f"expected a non-empty 'ios' list or 'input' and 'output'; the record has {sorted(record)}")


def convert(record: dict[str, Any], index: int, args: argparse.Namespace) -> Example:
    description, requirements, refcode = require(record, "problem_description", "io_requirements", "refcode")
    given_input, given_output = first_io(record)
    predict = args.predict if args.predict != "random" else record_rng(args, index).choice(["output", "input"])
    given_type, given = ("input", given_input) if predict == "output" else ("output", given_output)
    prompt = (f"You are given a problem with input and output variables:\n{description.strip()}\n\n"
              f"The input and output requirements:\n{requirements.strip()}\n\n"
              f"Given the following {given_type}:\n{json.dumps(given, ensure_ascii=False)}\n\n"
              f"{ASK[predict]}\n\nThis reference code may guide your reasoning (do not copy it):\n"
              f"```python\n{refcode.strip()}\n```")
    truth = {predict: given_output if predict == "output" else given_input}
    return Example(user_prompt(prompt), truth, {"predict": predict})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--predict", choices=["random", "output", "input"], default="random",
                        help="what each prompt asks for")


def main(argv: list[str] | None = None) -> Path:
    return run_script(convert, domain="simulation", name="codeio", description=__doc__, argv=argv,
                      add_arguments=add_arguments)


if __name__ == "__main__":
    main()
