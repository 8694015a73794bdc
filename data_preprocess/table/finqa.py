"""FinQA (czyssrs/FinQA) -> table__finqa.

Source fields (train.json / dev.json / test.json): `id`, `pre_text` and `post_text` (lists of sentences
around the table), `table` (a matrix whose first row is the header), `qa` (`question`, `answer` — e.g.
"14.1%" — `exe_ans`, the value the gold program computes, and `program`). The ground truth is `qa.answer`,
or `exe_ans` when the answer is empty.

    python -m data_preprocess.table.finqa --input FinQA/dataset/train.json --out data
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from data_preprocess.common import Example, RecordError, plain_number, require, run_script, user_prompt
from data_preprocess.table.layout import matrix_to_markdown, table_question


def convert(record: dict[str, Any], index: int, args: argparse.Namespace) -> Example:
    table, qa = require(record, "table", "qa")
    question = require(qa, "question")
    exe_ans = qa.get("exe_ans")
    answer = str(qa.get("answer") or "").strip() or (plain_number(exe_ans) if exe_ans is not None else "")
    if not answer:
        raise RecordError("neither qa.answer nor qa.exe_ans holds an answer")
    before = " ".join(record.get("pre_text") or [])
    after = " ".join(record.get("post_text") or [])
    prompt = table_question([matrix_to_markdown(table)], question, before=before, after=after)
    extra = {"id": str(record.get("id", index)), "program": str(qa.get("program") or "")}
    return Example(user_prompt(prompt), answer, extra)


def main(argv: list[str] | None = None) -> Path:
    return run_script(convert, domain="table", name="finqa", description=__doc__, argv=argv)


if __name__ == "__main__":
    main()
