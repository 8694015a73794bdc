"""Prompts streamed from parquet by row group: seeded shuffling, data-parallel sharding, epochs, resume.

The global order of an epoch is a pure function of (seed, epoch) and the row counts of the row groups,
so every rank computes the same one without reading any data: an RNG seeded by (seed, epoch) shuffles
the (file, row group) units, then their rows pass through a bounded shuffle buffer (a full buffer
emits a random entry for each row that enters). Rank r owns positions r, r + dp_size, r + 2 dp_size...
of that order. Row groups are read only when one of their rows is due on this rank, and dropped once
all their rows have passed, so a row group is read at most once per epoch and memory holds the shuffle
buffer's row groups, never a whole file. Resuming replays the order (integers only) and reads nothing
that was consumed before the checkpoint.

Images stay as they are stored (compressed bytes, or paths) until a rank renders or decodes them, so a stream of
image rows holds about `shuffle_buffer` rows plus one row group of compressed images, whatever the file's size
(tests/test_data_stream.py streams a 1 GB file of image rows within 300 MB): with large images, size the shuffle
buffer in bytes (1024 rows of 1 MB images hold 1 GB).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rl360.data.schema import DataError, extra_info_dict, validate_file_schema, validate_row

_STATE_VERSION = 1
_READ_ERRORS = (pa.ArrowException, OSError, ValueError)  # what pyarrow raises for unreadable bytes
JSONL_BLOCK_ROWS = 1024  # a jsonl file's rows are shuffled and read in blocks of this many lines (its row groups)


@dataclass(frozen=True)
class RowFormat:
    """What a stream's files hold: `check_row(row, path, index)` and `check_columns(path, arrow_schema)` raise
    `DataError` naming the file, row and key at fault; `jsonl`: `.jsonl` files (one JSON object a line) are read
    too, beside parquet."""

    check_row: Callable[[dict[str, Any], str, int], None] = validate_row
    check_columns: Callable[[str, pa.Schema], None] = validate_file_schema
    jsonl: bool = False


PROMPT_ROWS = RowFormat()  # RL prompts: the verl / Reasoning360 schema (rl360/data/schema.py), parquet only


def _is_jsonl(path: str) -> bool:
    return str(path).lower().endswith(".jsonl")


def expand_paths(paths: str | list[str], jsonl: bool = False) -> list[str]:
    """Files, directories (their *.parquet, and *.jsonl with `jsonl`, recursively) and globs -> data files.

    Each directory or glob expands in sorted order; entries keep the order given; duplicates are dropped.
    """
    found: list[str] = []
    patterns = ["*.parquet", *(["*.jsonl"] if jsonl else [])]
    for entry in [paths] if isinstance(paths, str) else list(paths):
        entry = os.fspath(entry)
        if os.path.isdir(entry):
            matches = sorted({path for pattern in patterns
                              for path in glob.glob(os.path.join(entry, "**", pattern), recursive=True)})
            if not matches:
                raise DataError(f"{entry}: directory holds no {' or '.join(patterns)} files")
        elif glob.has_magic(entry):
            matches = sorted(path for path in glob.glob(entry, recursive=True) if os.path.isfile(path))
            if not matches:
                raise DataError(f"{entry}: glob matches no files")
        elif os.path.isfile(entry):
            matches = [entry]
        else:
            raise DataError(f"{entry}: no such file or directory")
        found += [path for path in matches if path not in found]
    if not found:
        raise DataError(f"no parquet files given (paths={paths!r})")
    return found


def open_parquet(path: str, check_columns: Callable[[str, pa.Schema], None] = validate_file_schema
                 ) -> pq.ParquetFile:
    """Open a parquet file (reading only its footer) and check its schema (`check_columns`); errors name the
    file."""
    try:
        handle = pq.ParquetFile(path)
    except _READ_ERRORS as err:
        if str(path).lower().endswith((".jsonl", ".json", ".csv")):
            kind = "csv" if str(path).lower().endswith(".csv") else "json"
            lines = ", lines=True" if str(path).lower().endswith(".jsonl") else ""
            raise DataError(f"{path}: rl360 reads parquet files, not {kind}: convert it first, e.g. python -c "
                            f"\"import pandas as pd; pd.read_{kind}('{path}'{lines}).to_parquet('"
                            f"{os.path.splitext(path)[0]}.parquet')\"") from None
        raise DataError(f"{path}: cannot be read as parquet ({type(err).__name__}: {err})") from None
    try:
        check_columns(path, handle.schema_arrow)
    except DataError:
        handle.close()
        raise
    return handle


def scan_data_sources(paths: str | list[str]) -> set[str]:
    """Every distinct `data_source` in the files, reading only that column, row group by row group."""
    sources: set[str] = set()
    for path in expand_paths(paths):
        handle = open_parquet(path)
        try:
            for group in range(handle.num_row_groups):
                column = _read_group(handle, path, group, columns=["data_source"]).column(0)
                sources.update(value for value in column.unique().to_pylist() if value is not None)
        finally:
            handle.close()
    return sources


def scan_reward_keys(paths: str | list[str], count: bool = False) -> dict[tuple[str, Any], tuple]:
    """Every distinct (data_source, extra_info.reward_metric) pair of the files, in order of first appearance,
    each with the file and row index (within that file) where it first appears (and, with `count`, the number of
    rows with that pair).

    Reads only those two fields, row group by row group (a struct `extra_info` only its `reward_metric`
    field; a map column whole). A row without extra_info or without the key (or with a null or NaN) has the
    metric None; rows whose data_source is null are left to row validation. A metric that is not a plain
    value (a list, a struct) is given as its text.
    """
    found: dict[tuple[str, Any], tuple[str, int]] = {}
    rows: Counter = Counter()
    for path in expand_paths(paths):
        handle = open_parquet(path)
        try:
            columns, metric_of = _reward_metric_reader(handle.schema_arrow)
            first_row = 0
            for group in range(handle.num_row_groups):
                table = _read_group(handle, path, group, columns=columns)
                for (source, metric), offset, same in _reward_key_groups(table, metric_of):
                    key = (source, metric)
                    rows[key] += same
                    if key not in found:
                        found[key] = (path, first_row + offset)
                first_row += table.num_rows
        finally:
            handle.close()
    return {key: (*where, rows[key]) for key, where in found.items()} if count else found


def _reward_key_groups(table: pa.Table, metric_of: Callable[[Any], Any]) -> list[tuple[tuple[str, Any], int, int]]:
    """((data_source, metric), first row, rows) of each pair in a row group with a data_source, in order of
    first row. Columnar (pyarrow's group_by) where the metric is absent or a plain struct field; else each
    row's extra_info through `metric_of`."""
    sources = table.column("data_source").combine_chunks()
    if "extra_info" in table.column_names:
        extra = table.column("extra_info").combine_chunks()
        metric = pc.struct_field(extra, "reward_metric") if pa.types.is_struct(extra.type) else None
        plain = metric is not None and (pa.types.is_string(metric.type) or pa.types.is_integer(metric.type)
                                        or pa.types.is_floating(metric.type) or pa.types.is_boolean(metric.type))
        if not plain:
            metrics = [metric_of(value) for value in extra.to_pylist()]
            groups: dict[tuple[str, Any], list[int]] = {}
            for offset, key in enumerate(zip(sources.to_pylist(), metrics)):
                if key[0] is not None:
                    groups.setdefault(key, [offset, 0])[1] += 1
            return [(key, first, same) for key, (first, same) in groups.items()]
    else:
        metric = pa.nulls(len(sources), pa.string())
    keyed = pa.table({"s": sources, "m": metric, "i": pa.array(range(len(sources)), pa.int64())})
    summary = keyed.group_by(["s", "m"], use_threads=False).aggregate([("i", "min"), ("i", "count")])
    merged: dict[tuple[str, Any], list[int]] = {}
    for row in sorted(summary.to_pylist(), key=lambda r: r["i_min"]):
        if row["s"] is None:
            continue
        key = (row["s"], _plain(row["m"]))  # a NaN metric joins the None ones
        if key in merged:
            merged[key][1] += row["i_count"]
        else:
            merged[key] = [row["i_min"], row["i_count"]]
    return [(key, first, same) for key, (first, same) in merged.items()]


def _reward_metric_reader(schema: pa.Schema) -> tuple[list[str], Callable[[Any], Any]]:
    """The columns to read for data_source and extra_info.reward_metric, and how to get the metric from a
    read extra_info value."""
    index = schema.get_field_index("extra_info")
    kind = schema.field(index).type if index >= 0 else None
    if kind is not None and pa.types.is_struct(kind) and kind.get_field_index("reward_metric") >= 0:
        return ["data_source", "extra_info.reward_metric"], lambda extra: _plain((extra or {}).get("reward_metric"))
    if kind is not None and pa.types.is_map(kind):
        return ["data_source", "extra_info"], lambda extra: _plain(extra_info_dict(extra or []).get("reward_metric"))
    return ["data_source"], lambda extra: None


def _plain(value: Any) -> Any:
    """A hashable metric value: None (also for a float NaN, pandas' missing value), a string or number as it
    is, anything else as its text."""
    if isinstance(value, float) and value != value:
        return None
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


def _read_group(handle: pq.ParquetFile, path: str, group: int, columns: list[str] | None = None) -> pa.Table:
    try:
        return handle.read_row_group(group, columns=columns)
    except _READ_ERRORS as err:
        raise DataError(f"{path}: row group {group} cannot be read ({type(err).__name__}: {err})") from None


@dataclass(frozen=True)
class _Unit:
    """One row group: the unit that is shuffled and read."""

    file: int  # index into PromptStream.files
    group: int  # row group index within the file
    first_row: int  # index within the file of the group's first row
    num_rows: int


class PromptStream:
    """An infinite iterator of batches (lists of row dicts) over parquet prompt files.

    Each row is the file's row as Python objects plus `_source = {"file": path, "row": index_in_file}`.
    Rows are validated (`validate_row`), then passed to `select_fn` and `filter_fn`. A bad row raises
    DataError (`on_bad_row="error"`) or is skipped and counted (`"skip"`). A row for which `select_fn` is
    false belongs to another stream reading the same file (a mixed stream's other source): it is passed over
    and counted apart, and when it is also bad it is left to the stream that selects it. A row for which
    `filter_fn` is false (the prompt-length filter) is dropped and counted. All of this happens on this
    rank's share only, after sharding. With `drop_last`, a rank's last incomplete batch of an epoch is
    dropped; otherwise it is yielded short.
    """

    def __init__(self, paths: str | list[str], batch_size: int, seed: int = 0, shuffle: bool = True,
                 dp_rank: int = 0, dp_size: int = 1, shuffle_buffer: int = 1024, on_bad_row: str = "error",
                 drop_last: bool = True, filter_fn: Callable[[dict[str, Any]], bool] | None = None,
                 select_fn: Callable[[dict[str, Any]], bool] | None = None, row_format: RowFormat = PROMPT_ROWS):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}; it must be at least 1")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank}, dp_size={dp_size}; need dp_size >= 1 and 0 <= dp_rank < dp_size")
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer={shuffle_buffer}; it must be at least 1")
        if on_bad_row not in ("error", "skip"):
            raise ValueError(f"on_bad_row={on_bad_row!r}; allowed values are 'error' and 'skip'")
        self.row_format = row_format
        self.files = expand_paths(paths, jsonl=row_format.jsonl)
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.dp_rank, self.dp_size, self.shuffle_buffer = dp_rank, dp_size, shuffle_buffer
        self.on_bad_row, self.drop_last = on_bad_row, drop_last
        self.filter_fn, self.select_fn = filter_fn, select_fn
        self.units = self._scan_units()
        self.num_rows = sum(unit.num_rows for unit in self.units)
        if self.num_rows == 0:
            raise DataError(f"no rows in {self.files}")
        self._epoch = 0
        self._consumed = 0  # positions of the current epoch's order owned by this rank and processed
        self._counts = {"rows_seen": 0, "rows_filtered": 0, "bad_rows_skipped": 0, "rows_not_selected": 0}
        self._batches: Iterator[list[dict[str, Any]]] | None = None
        self._handle: tuple[int, pq.ParquetFile] | None = None  # the one open file

    # ----- public surface -------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the next batch is taken from (it advances when an epoch's rows run out)."""
        return self._epoch

    def stats(self) -> dict[str, int]:
        """Counts on this rank since the start of training (restored by load_state_dict).

        rows_seen: rows read and checked; rows_filtered: dropped by filter_fn; bad_rows_skipped: rows that
        failed validate_row under on_bad_row="skip"; rows_not_selected: rows passed over for select_fn.
        """
        return {**self._counts, "epoch": self._epoch}

    def skipped(self) -> dict[str, int]:
        """Rows left out of batches on this rank since the start of training: `bad_rows` (failing validate_row
        under on_bad_row="skip") and `filtered` (dropped by filter_fn, e.g. prompts over max_prompt_length)."""
        return {"bad_rows": self._counts["bad_rows_skipped"], "filtered": self._counts["rows_filtered"]}

    def state_dict(self) -> dict[str, Any]:
        """A small JSON-serializable position: a fresh stream that loads it yields the same next batches."""
        return {"version": _STATE_VERSION, "epoch": self._epoch, "consumed": self._consumed, "seed": self.seed,
                "shuffle": self.shuffle, "shuffle_buffer": self.shuffle_buffer, "dp_rank": self.dp_rank,
                "dp_size": self.dp_size, "num_rows": self.num_rows, "fingerprint": self._fingerprint(),
                "counts": dict(self._counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (from state_dict of a stream built with the same data and order settings)."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"data state version {state.get('version')!r}; this code reads {_STATE_VERSION}")
        mine = self.state_dict()
        for key in ("seed", "shuffle", "shuffle_buffer", "dp_rank", "dp_size", "num_rows", "fingerprint"):
            if state[key] != mine[key]:
                raise ValueError(f"data state key {key!r} was {state[key]!r} when saved, this stream has "
                                 f"{mine[key]!r}; resuming would not continue the same order")
        self._close_batches()
        self._epoch, self._consumed = int(state["epoch"]), int(state["consumed"])
        self._counts = {key: int(state["counts"].get(key, 0)) for key in self._counts}

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> list[dict[str, Any]]:
        if self._batches is None:
            self._batches = self._generate_batches()
        try:
            return next(self._batches)
        except BaseException:  # a bad row or a failing filter_fn: the next call retries the same position
            self._batches = None
            raise

    def close(self) -> None:
        """Release the open file and the row groups held by the current position (iteration may go on)."""
        self._close_batches()
        if self._handle is not None:
            self._handle[1].close()
            self._handle = None

    # ----- the order --------------------------------------------------------------------------------

    def _scan_units(self) -> list[_Unit]:
        units: list[_Unit] = []
        self._blocks: dict[int, list[tuple[int, int]]] = {}  # a jsonl file's blocks: (byte offset, byte length)
        for index, path in enumerate(self.files):
            if self.row_format.jsonl and _is_jsonl(path):
                first = 0
                self._blocks[index] = []
                for group, (offset, length, rows) in enumerate(jsonl_blocks(path)):
                    units.append(_Unit(index, group, first, rows))
                    self._blocks[index].append((offset, length))
                    first += rows
                continue
            handle = open_parquet(path, self.row_format.check_columns)
            try:
                first = 0
                for group in range(handle.num_row_groups):
                    rows = handle.metadata.row_group(group).num_rows
                    if rows:
                        units.append(_Unit(index, group, first, rows))
                    first += rows
            finally:
                handle.close()
        return units

    def _fingerprint(self) -> str:
        """Identifies the row-group layout (not the paths, so a moved dataset still resumes)."""
        layout = ";".join(f"{unit.file},{unit.group},{unit.num_rows}" for unit in self.units)
        return hashlib.sha256(layout.encode()).hexdigest()[:16]

    def _epoch_order(self, epoch: int) -> Iterator[tuple[int, int]]:
        """(unit index, row within the unit) in the epoch's global order, identical on every rank."""
        if not self.shuffle:
            for unit_index, unit in enumerate(self.units):
                for row in range(unit.num_rows):
                    yield unit_index, row
            return
        rng = random.Random(f"rl360.data:{self.seed}:{epoch}")
        order = list(range(len(self.units)))
        rng.shuffle(order)
        buffer: list[tuple[int, int]] = []
        size = self.shuffle_buffer
        for unit_index in order:
            for row in range(self.units[unit_index].num_rows):
                if len(buffer) < size:
                    buffer.append((unit_index, row))
                    continue
                pick = rng.randrange(size)
                yield buffer[pick]
                buffer[pick] = (unit_index, row)
        rng.shuffle(buffer)
        yield from buffer

    # ----- reading ----------------------------------------------------------------------------------

    def _rows(self, epoch: int, skip: int) -> Iterator[dict[str, Any] | None]:
        """This rank's rows of `epoch` after its first `skip`; None stands for a filtered or bad row."""
        left = [unit.num_rows for unit in self.units]  # rows of each unit still to pass in this epoch
        # Rows (as Python objects) of row groups that were read and still have rows to pass; each row is
        # dropped as its position passes, so memory holds about the shuffle buffer's rows, not whole
        # row groups kept alive by one lingering row.
        pending: dict[int, list[dict[str, Any] | None]] = {}
        owned = 0
        for position, (unit_index, row) in enumerate(self._epoch_order(epoch)):
            rows = pending.get(unit_index)
            if position % self.dp_size == self.dp_rank:
                owned += 1
                if owned > skip:
                    if rows is None:
                        rows = pending[unit_index] = self._read_unit(self.units[unit_index])
                    record, rows[row] = rows[row], None
                    yield self._check(record, self.units[unit_index], row)
            elif rows is not None:
                rows[row] = None
            left[unit_index] -= 1
            if left[unit_index] == 0:
                pending.pop(unit_index, None)

    def _read_unit(self, unit: _Unit) -> list[dict[str, Any]]:
        if unit.file in self._blocks:
            offset, length = self._blocks[unit.file][unit.group]
            return read_jsonl_block(self.files[unit.file], offset, length, unit.first_row)
        if self._handle is None or self._handle[0] != unit.file:
            if self._handle is not None:
                self._handle[1].close()
                self._handle = None
            self._handle = (unit.file, open_parquet(self.files[unit.file], self.row_format.check_columns))
        return _read_group(self._handle[1], self.files[unit.file], unit.group).to_pylist()

    def _check(self, row: dict[str, Any], unit: _Unit, row_in_unit: int) -> dict[str, Any] | None:
        path, index = self.files[unit.file], unit.first_row + row_in_unit
        self._counts["rows_seen"] += 1
        try:
            self.row_format.check_row(row, path, index)
        except DataError:
            if self.select_fn is not None and isinstance(row.get("data_source"), str) and not self.select_fn(row):
                self._counts["rows_not_selected"] += 1  # another stream's bad row: it skips or raises
                return None
            if self.on_bad_row == "error":
                raise
            self._counts["bad_rows_skipped"] += 1
            return None
        row["_source"] = {"file": path, "row": index}
        row["extra_info"] = extra_info_dict(row.get("extra_info"))  # a map column's pairs as a dict
        if self.select_fn is not None and not self.select_fn(row):
            self._counts["rows_not_selected"] += 1
            return None
        if self.filter_fn is not None:
            try:
                keep = self.filter_fn(row)
            except Exception as err:
                err.add_note(f"in filter_fn on {path} row {index}")
                raise
            if not keep:
                self._counts["rows_filtered"] += 1
                return None
        return row

    # ----- batching ---------------------------------------------------------------------------------

    def _generate_batches(self) -> Iterator[list[dict[str, Any]]]:
        while True:
            from_start = self._consumed == 0
            produced = 0
            batch: list[dict[str, Any]] = []
            for row in self._rows(self._epoch, self._consumed):
                self._consumed += 1
                if row is None:
                    continue
                batch.append(row)
                if len(batch) == self.batch_size:
                    produced += 1
                    yield batch
                    batch = []
            if batch and not self.drop_last:
                produced += 1
                yield batch
            if from_start and not produced:
                raise DataError(f"epoch {self._epoch} gave dp rank {self.dp_rank} no batch of {self.batch_size} "
                                f"(drop_last={self.drop_last}) from {self.num_rows} rows in {len(self.files)} "
                                f"file(s); counts so far: {self._counts}")
            self._epoch += 1
            self._consumed = 0

    def _close_batches(self) -> None:
        if self._batches is not None:
            self._batches.close()
            self._batches = None


def jsonl_blocks(path: str, rows_per_block: int = JSONL_BLOCK_ROWS) -> list[tuple[int, int, int]]:
    """A jsonl file's blocks of `rows_per_block` rows (non-blank lines): (byte offset, byte length, rows) each,
    found in one pass that keeps no line."""
    blocks: list[tuple[int, int, int]] = []
    start = position = rows = 0
    try:
        with open(path, "rb") as handle:
            for line in handle:
                if line.strip():
                    if rows == rows_per_block:
                        blocks.append((start, position - start, rows))
                        start, rows = position, 0
                    rows += 1
                position += len(line)
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err})") from None
    if rows:
        blocks.append((start, position - start, rows))
    return blocks


def read_jsonl_block(path: str, offset: int, length: int, first_row: int) -> list[dict[str, Any]]:
    """The rows of one block of a jsonl file (`jsonl_blocks`); a line that is not a JSON object is a `DataError`
    naming the file and its row."""
    with open(path, "rb") as handle:
        handle.seek(offset)
        lines = [line for line in handle.read(length).splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, start=first_row):
        try:
            row = json.loads(line)
        except ValueError as err:
            raise DataError(f"{path} row {number}: not a JSON line ({err})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path} row {number}: a JSON {type(row).__name__}, not an object")
        rows.append(row)
    return rows
