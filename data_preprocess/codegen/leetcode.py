"""LeetCodeDataset (newfacade/LeetCodeDataset) -> codegen__leetcode.

Source fields: `problem_description`, `starter_code`, `test` (a `def check(candidate): ...` function),
`entry_point` (e.g. "Solution().twoSum"), `prompt` (the imports the reference solution runs after),
`completion` (the reference solution), `task_id`, `difficulty`. The ground truth is
`{"functional": "<test>\\n\\ncheck(<entry_point>)"}`; the import prelude goes to extra_info.prefix and the
prompt asks the model to include the imports its code needs.

    python -m data_preprocess.codegen.leetcode --input LeetCodeDataset-train.jsonl --out data
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from data_preprocess.codegen.truth import code_prompt
from data_preprocess.common import Example, require, run_script, user_prompt

IMPORTS_NOTE = "Include every import your code needs (for example `from typing import List`)."


def convert(record: dict[str, Any], index: int, args: argparse.Namespace) -> Example:
    description, test, entry_point = require(record, "problem_description", "test", "entry_point")
    starter = record.get("starter_code") or ""
    truth = json.dumps({"functional": f"{test.rstrip()}\n\ncheck({entry_point.strip()})\n"})
    extra = {"task_id": str(record.get("task_id") or ""), "difficulty": str(record.get("difficulty") or ""),
             "prefix": str(record.get("prompt") or ""), "reference": str(record.get("completion") or "")}
    return Example(user_prompt(code_prompt(description, starter, IMPORTS_NOTE)), truth, extra)


def main(argv: list[str] | None = None) -> Path:
    return run_script(convert, domain="codegen", name="leetcode", description=__doc__, argv=argv)


if __name__ == "__main__":
    main()
