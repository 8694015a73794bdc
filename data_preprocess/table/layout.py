"""Tables as markdown for table-reasoning prompts: from a matrix of cells, or from HTML (with colspan)."""

from __future__ import annotations

from html.parser import HTMLParser
from typing import Any

from data_preprocess.common import BOXED


def _cell(value: Any) -> str:
    return " ".join(str(value if value is not None else "").split()).replace("|", "\\|")


def matrix_to_markdown(rows: list[list[Any]]) -> str:
    """A markdown table whose first row is the header; short rows are padded with empty cells."""
    if not rows:
        return ""
    width = max(len(row) for row in rows)
    lines = ["| " + " | ".join([_cell(value) for value in row] + [""] * (width - len(row))) + " |" for row in rows]
    lines.insert(1, "|" + "---|" * width)
    return "\n".join(lines)


class _TableCells(HTMLParser):
    """Collects the rows of <tr> elements as lists of cell texts; a cell with colspan=k fills k columns
    (its text in the first, the rest empty)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._cell: list[str] | None = None
        self._span = 1

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            if not self.rows:
                self.rows.append([])
            self._cell = []
            span = dict(attrs).get("colspan") or "1"
            self._span = int(span) if span.isdigit() and int(span) > 0 else 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1] += ["".join(self._cell).strip()] + [""] * (self._span - 1)
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def html_to_markdown(html: str) -> str:
    """The <tr>/<td>/<th> cells of an HTML table as a markdown table."""
    parser = _TableCells()
    parser.feed(html)
    parser.close()
    return matrix_to_markdown([row for row in parser.rows if row])


def table_question(tables: list[str], question: str, before: str = "", after: str = "",
                   answer_note: str = "") -> str:
    """The table-reasoning prompt: optional text before, the markdown tables, text after, the question and
    the \\boxed{} instruction (plus `answer_note`)."""
    parts = ["You are given one or more tables" + (" and some text" if before or after else "")
             + ". Use the information in them to answer the question."]
    if before.strip():
        parts.append(before.strip())
    parts += [table for table in tables if table]
    if after.strip():
        parts.append(after.strip())
    parts.append(f"Question: {question.strip()}")
    parts.append(f"{BOXED} {answer_note}".strip())
    return "\n\n".join(parts)
