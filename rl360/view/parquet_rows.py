"""Parquet files (one, or every `*.parquet` under a directory, in name order) as viewer rows, without reading
them whole: row counts come from the files' metadata, a page reads only the row groups it spans (within a
group's first 1,024 rows, only those; the last two read are kept), a row's detail only its own row group.

The `data_source` filter reads only that column of each row group (once per value, then cached: the total of
matches), and then only the row groups holding the page's matches; its options read the column once too."""

from __future__ import annotations

import bisect
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rl360.errors import UserError
from rl360.view.values import jsonable, preview

FILTER_COLUMN = "data_source"
_KEPT_GROUPS = 2
_FIRST_BATCH_ROWS = 1024  # a page within a row group's first rows decodes only these


class ParquetSource:
    kind = "parquet"

    def __init__(self, path: Path):
        self.path = path
        files = sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
        if not files:
            raise UserError(f"{path} holds no *.parquet files")
        self.file_paths = files
        self.files: list[pq.ParquetFile] = []
        self.groups: list[tuple[int, int]] = []  # (file, row group) in order
        self.starts: list[int] = []  # global index of each group's first row
        total = 0
        for number, file in enumerate(files):
            try:
                parquet = pq.ParquetFile(file)
            except (OSError, pa.ArrowException) as err:
                raise UserError(f"{file} is not a readable parquet file: {err}") from None
            self.files.append(parquet)
            for group in range(parquet.metadata.num_row_groups):
                rows = parquet.metadata.row_group(group).num_rows
                if rows:
                    self.groups.append((number, group))
                    self.starts.append(total)
                    total += rows
        self.total = total
        self.columns = self.files[0].schema_arrow.names
        self._tables: OrderedDict[int, pa.Table] = OrderedDict()
        self._matches: dict[str, dict[int, pa.Array]] = {}  # data_source -> group -> local row indices
        self._sources: list[str] | None = None

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": str(self.path), "total": self.total, "columns": self.columns,
                "summary": {"files": len(self.files), "row_groups": len(self.groups), "rows": self.total},
                "curve": False}

    def filters(self, scan: bool = True) -> list[dict[str, Any]]:
        """The data_source filter with its options (`scan`: read them if not yet; else null until read)."""
        if FILTER_COLUMN not in self.columns:
            return []
        if self._sources is None and scan:
            values: set[str] = set()
            for position in range(len(self.groups)):
                values.update(str(v) for v in pc.unique(self._column(position)).to_pylist() if v is not None)
            self._sources = sorted(values)
        return [{"name": FILTER_COLUMN, "options": self._sources}]

    def page(self, offset: int, limit: int, chosen: dict[str, str]) -> dict[str, Any]:
        source = chosen.get(FILTER_COLUMN)
        if source and FILTER_COLUMN in self.columns:
            return self._filtered_page(offset, limit, source)
        rows, index = [], offset
        while index < min(offset + limit, self.total):
            position = bisect.bisect_right(self.starts, index) - 1
            local = index - self.starts[position]
            take = min(offset + limit - index, self._group_rows(position) - local)
            for k, record in enumerate(self._slice(position, local, take)):
                rows.append(self._summary(index + k, record))
            index += take
        return {"total": self.total, "rows": rows}

    def row(self, index: int) -> dict[str, Any]:
        position = bisect.bisect_right(self.starts, index) - 1
        record = self._slice(position, index - self.starts[position], 1)[0]
        number, group = self.groups[position]
        return {"index": index, "file": str(self.file_paths[number]),
                "row_group": group, "fields": jsonable(record, inline_images=True)}

    # ---- reading ----
    def _filtered_page(self, offset: int, limit: int, source: str) -> dict[str, Any]:
        """Matches offset .. offset+limit: groups scanned in order (only the filter column) until they are found;
        the total once every group's column has been scanned."""
        matches = self._matches.setdefault(source, {})
        rows, seen = [], 0
        for position in range(len(self.groups)):
            if position not in matches:
                matches[position] = pc.indices_nonzero(pc.equal(self._column(position), source))
            found = matches[position]
            if len(rows) < limit and seen + len(found) > offset:
                local = found.to_pylist()[max(0, offset - seen):][:limit - len(rows)]
                table = self._table(position, local[-1] + 1)
                start = self.starts[position]
                rows += [self._summary(start + i, table.slice(i, 1).to_pylist()[0]) for i in local]
            seen += len(found)
        return {"total": seen, "rows": rows}

    def _column(self, position: int) -> pa.Array:
        number, group = self.groups[position]
        return self.files[number].read_row_group(group, columns=[FILTER_COLUMN]).column(0).combine_chunks()

    def _group_rows(self, position: int) -> int:
        number, group = self.groups[position]
        return self.files[number].metadata.row_group(group).num_rows

    def _slice(self, position: int, start: int, count: int) -> list[dict]:
        return self._table(position, start + count).slice(start, count).to_pylist()

    def _table(self, position: int, rows_needed: int) -> pa.Table:
        """At least the first `rows_needed` rows of a row group: the group's first record batch when they fit in
        it (a first page decodes only that), else the whole group; the last two read are kept."""
        kept = self._tables.get(position)
        if kept is not None and kept.num_rows >= rows_needed:
            self._tables.move_to_end(position)
            return kept
        number, group = self.groups[position]
        if rows_needed <= _FIRST_BATCH_ROWS:
            batch = next(self.files[number].iter_batches(batch_size=_FIRST_BATCH_ROWS, row_groups=[group]))
            table = pa.Table.from_batches([batch])
        else:
            table = self.files[number].read_row_group(group)
        self._tables[position] = table
        self._tables.move_to_end(position)
        while len(self._tables) > _KEPT_GROUPS:
            self._tables.popitem(last=False)
        return table

    def _summary(self, index: int, record: dict) -> dict[str, Any]:
        return {"index": index, **{key: preview(jsonable(value, inline_images=False))
                                   for key, value in record.items()}}
