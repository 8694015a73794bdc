"""Reading tables written as CSV, TSV, JSON, JSONL, HTML or markdown, and comparing two of them (for LiveBench's
`tablereformat`); standard library only.

A table is its column names and its rows (one dict per row, column name -> cell). Accepted writings:

- csv / tsv: a header line, then rows; short rows are padded with empty cells, a row longer than the header
  makes the text unreadable;
- json: a list of row objects ("records"), an object of row objects keyed by row label ("index"; the labels are
  dropped), or pandas' "table" layout ({"schema": …, "data": [row objects]});
- jsonl: one row object per line (lines that are not objects are skipped);
- html: the <tr> rows of every <table>; the first row of <th> cells is the header;
- markdown: the lines holding "|", outer pipes dropped, "---" separator rows skipped; the first is the header.

Empty column names become "Unnamed: <position>" and repeated ones get ".1", ".2", … (as pandas names them).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from html.parser import HTMLParser

FORMATS = ("csv", "tsv", "json", "jsonl", "html", "markdown")
FLOAT_TOLERANCE = 1e-6
MISSING = frozenset({"", "nan", "NaN", "NULL", "null", "None", "N/A", "NA", "n/a", "#N/A"})
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_SEPARATOR_CELL = re.compile(r":?-+:?")

Table = tuple[list[str], list[dict]]


def read_table(text: str, fmt: str) -> Table | None:
    """The table written in `text` in format `fmt` (one of `FORMATS`), or None when it cannot be read as one."""
    readers = {"csv": lambda t: _read_delimited(t, ","), "tsv": lambda t: _read_delimited(t, "\t"),
               "json": _read_json, "jsonl": _read_jsonl, "html": _read_html, "markdown": _read_markdown}
    if fmt not in readers:
        raise ValueError(f"unknown table format {fmt!r}; known: {list(FORMATS)}")
    try:
        table = readers[fmt](text)
    except (ValueError, csv.Error, RecursionError):
        return None
    if table is None or not table[0]:
        return None
    return table


def tables_equal(given: Table, wanted: Table) -> bool:
    """The same columns (any order, names stripped, an "index" column ignored), the same number of rows, and
    row by row equal cells: numbers within `FLOAT_TOLERANCE`, missing cells (empty, NaN, null) alike, other
    cells as stripped text."""
    given_columns, given_rows = _without_index(given)
    wanted_columns, wanted_rows = _without_index(wanted)
    if sorted(given_columns) != sorted(wanted_columns) or len(given_rows) != len(wanted_rows):
        return False
    return all(cells_equal(g.get(c), w.get(c)) for g, w in zip(given_rows, wanted_rows) for c in wanted_columns)


def cells_equal(a, b) -> bool:
    """Whether two cells are equal in the sense of `tables_equal`."""
    if _is_missing(a) or _is_missing(b):
        return _is_missing(a) and _is_missing(b)
    x, y = _as_float(a), _as_float(b)
    if x is not None and y is not None:
        return abs(x - y) < FLOAT_TOLERANCE
    return str(a).strip() == str(b).strip()


def rows_from_header(text: str, header_line: str, fmt: str) -> Table | None:
    """The csv/tsv table starting at the line of `text` that equals `header_line`, up to the next blank line (for
    answers with words around the table); None when no line is the header or the rest is unreadable."""
    lines = text.strip().split("\n")
    start = next((i for i, line in enumerate(lines) if line.strip() == header_line.strip()), None)
    if start is None:
        return None
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return read_table("\n".join(lines[start:end]), fmt)


def _read_delimited(text: str, sep: str) -> Table | None:
    lines = [row for row in csv.reader(io.StringIO(text.strip()), delimiter=sep) if row]  # blank lines skipped
    if not lines:
        return None
    return _header_and_rows(lines)


def _header_and_rows(lines: list[list[str]]) -> Table | None:
    """The first line's cells as column names, each later line as a row (short lines padded with ""); None
    when a line has more cells than there are columns."""
    columns = _column_names(lines[0])
    rows = []
    for cells in lines[1:]:
        if len(cells) > len(columns):
            return None
        rows.append(dict(zip(columns, cells + [""] * (len(columns) - len(cells)))))
    return columns, rows


def _read_json(text: str) -> Table | None:
    try:
        value = json.loads(text)
    except ValueError:
        return _read_jsonl(text)  # several objects, one a line
    if isinstance(value, dict) and isinstance(value.get("data"), list) and "schema" in value:
        value = value["data"]
    elif isinstance(value, dict) and value and all(isinstance(row, dict) for row in value.values()):
        value = list(value.values())
    if not isinstance(value, list) or not value or not all(isinstance(row, dict) for row in value):
        return None
    return _from_records(value)


def _read_jsonl(text: str) -> Table | None:
    records = []
    for line in text.strip().split("\n"):
        line = line.strip()
        if not (line.startswith("{") and line.endswith("}")):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return _from_records(records) if records else None


def _from_records(records: list[dict]) -> Table:
    columns = list(dict.fromkeys(str(key) for record in records for key in record))
    return columns, [{str(key): value for key, value in record.items()} for record in records]


def _read_markdown(text: str) -> Table | None:
    lines = []
    for line in text.strip().split("\n"):
        line = line.strip()
        if "|" not in line:
            continue
        line = line[1:] if line.startswith("|") else line
        line = line[:-1] if line.endswith("|") else line
        cells = [cell.strip() for cell in line.split("|")]
        if all(_SEPARATOR_CELL.fullmatch(cell) for cell in cells):
            continue
        lines.append(cells)
    if not lines:
        return None
    return _header_and_rows(lines)


def _read_html(text: str) -> Table | None:
    parser = _TableRows()
    parser.feed(text)
    parser.close()
    header_at = next((i for i, (cells, all_th) in enumerate(parser.rows) if all_th and cells), None)
    if header_at is None:
        return None
    columns = _column_names(parser.rows[header_at][0])
    rows = []
    for cells, all_th in parser.rows[header_at + 1:]:
        if all_th and cells == parser.rows[header_at][0]:
            continue  # the header again (a second table, or a repeated header)
        if len(cells) > len(columns):
            return None
        rows.append(dict(zip(columns, cells + [""] * (len(columns) - len(cells)))))
    return columns, rows


class _TableRows(HTMLParser):
    """Collects every <tr> as (cell texts, whether all its cells are <th>)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.rows: list[tuple[list[str], bool]] = []
        self._cells: list[str] | None = None
        self._all_th = True
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag == "tr":
            self._end_row()
            self._cells, self._all_th = [], True
        elif tag in ("td", "th") and self._cells is not None:
            self._end_cell()
            self._cell = []
            self._all_th = self._all_th and tag == "th"

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th"):
            self._end_cell()
        elif tag in ("tr", "table"):
            self._end_row()

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)

    def close(self) -> None:
        super().close()
        self._end_row()

    def _end_cell(self) -> None:
        if self._cell is not None and self._cells is not None:
            self._cells.append(" ".join("".join(self._cell).split()))
        self._cell = None

    def _end_row(self) -> None:
        self._end_cell()
        if self._cells:
            self.rows.append((self._cells, self._all_th))
        self._cells = None


def _column_names(names: list[str]) -> list[str]:
    columns, seen = [], {}
    for position, name in enumerate(names):
        name = name.strip() or f"Unnamed: {position}"
        if name in seen:
            seen[name] += 1
            name = f"{name}.{seen[name]}"
        else:
            seen[name] = 0
        columns.append(name)
    return columns


def _without_index(table: Table) -> Table:
    columns, rows = table
    columns = [column.strip() for column in columns]
    rows = [{str(key).strip(): value for key, value in row.items()} for row in rows]
    return [column for column in columns if column != "index"], rows


def _is_missing(value) -> bool:
    if value is None:
        return True
    if isinstance(value, float):
        return math.isnan(value)
    return isinstance(value, str) and value.strip() in MISSING


def _as_float(value) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value.strip())
    return None
