"""HiTab (microsoft/HiTab) -> table__hitab.

Source fields (train_samples.jsonl / dev / test): `id`, `question`, `answer` (a list of values), `aggregation`,
`table_id`; the table is `tables/raw/<table_id>.json` under --tables-dir (its `texts` matrix), or an inline
`table` field (a matrix, or an object with `texts`). The ground truth is the answers joined with "|"; the
prompt asks for them, so separated, inside \\boxed{}.

    python -m data_preprocess.table.hitab --input hitab/train_samples.jsonl --tables-dir hitab/tables/raw --out data
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from data_preprocess.common import Example, RecordError, plain_number, require, run_script, to_text, user_prompt
from data_preprocess.table.layout import matrix_to_markdown, table_question

SEVERAL = "If there are several answers, separate them with |."


def table_cells(record: dict[str, Any], tables_dir: str | None) -> list[list[Any]]:
    table = record.get("table")
    if table is None:
        table_id = require(record, "table_id")
        if tables_dir is None:
            raise RecordError(f"the record names table_id {table_id!r} but no --tables-dir was given")
        path = Path(tables_dir) / f"{table_id}.json"
        if not path.is_file():
            raise RecordError(f"table file {path} not found")
        table = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(table, dict):
        table = require(table, "texts")
    if not isinstance(table, list) or not all(isinstance(row, list) for row in table):
        raise RecordError("the table must be a matrix (a list of rows)")
    return table


def convert(record: dict[str, Any], index: int, args: argparse.Namespace) -> Example:
    question, answer = require(record, "question", "answer")
    answers = answer if isinstance(answer, list) else [answer]
    if not answers:
        raise RecordError("field 'answer' is empty")
    prompt = table_question([matrix_to_markdown(table_cells(record, args.tables_dir))], question, answer_note=SEVERAL)
    extra = {"id": str(record.get("id", index)), "aggregation": to_text(record.get("aggregation") or [])}
    return Example(user_prompt(prompt), "|".join(plain_number(value) for value in answers), extra)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tables-dir", default=None, help="directory of <table_id>.json files (tables/raw)")


def main(argv: list[str] | None = None) -> Path:
    return run_script(convert, domain="table", name="hitab", description=__doc__, argv=argv,
                      add_arguments=add_arguments)


if __name__ == "__main__":
    main()
