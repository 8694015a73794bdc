"""MultiHiertt (psunlpgroup/MultiHiertt) -> table__multihiertt.

Source fields (train.json / dev.json): `uid`, `paragraphs` (a list of sentences), `tables` (a list of HTML
tables, some with hierarchical headers), `qa` (`question`, `answer`, `question_type`, `text_evidence`). The
prompt holds the paragraphs and the tables as markdown, the question and the \\boxed{} instruction; the
ground truth is the answer. With --table-only the paragraphs are left out, and so are the questions whose
evidence includes them (non-empty `text_evidence`).

    python -m data_preprocess.table.multihiertt --input MultiHiertt_dataset/train.json --out data
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from data_preprocess.common import Example, RecordError, plain_number, require, run_script, user_prompt
from data_preprocess.table.layout import html_to_markdown, table_question


def convert(record: dict[str, Any], index: int, args: argparse.Namespace) -> Example | None:
    tables, qa = require(record, "tables", "qa")
    question, answer = require(qa, "question", "answer")
    if args.table_only and qa.get("text_evidence"):
        return None
    answer = plain_number(answer)
    if not answer:
        raise RecordError("field 'qa.answer' is empty")
    paragraphs = [] if args.table_only else record.get("paragraphs") or []
    prompt = table_question([html_to_markdown(table) for table in tables], question, before="\n".join(paragraphs))
    extra = {"id": str(record.get("uid", index)), "question_type": str(qa.get("question_type") or "")}
    return Example(user_prompt(prompt), answer, extra)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--table-only", action="store_true",
                        help="leave out the paragraphs and the questions that need them")


def main(argv: list[str] | None = None) -> Path:
    return run_script(convert, domain="table", name="multihiertt", description=__doc__, argv=argv,
                      add_arguments=add_arguments)


if __name__ == "__main__":
    main()
