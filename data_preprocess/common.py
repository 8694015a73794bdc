"""What every preprocessing script shares: reading the source records, the answer-format instructions,
building a row of the standard schema, the command line, and writing a checked parquet file.

A script defines `convert(record, index, args) -> Example | None` (`index` is the record's position in the
input; None leaves the record out on purpose, e.g. a problem without tests) and calls
`run_script(convert, domain=..., name=..., description=__doc__)`. The rows get
`data_source = "<domain>__<name>"`, `ability = <domain>`, `reward_model = {style: rule, ground_truth}` and
`extra_info = {split, index, **example.extra}`. Every row is checked with `rl360.data.validate_row` and the
file with `validate_file_schema` before the file appears (it is written to a temporary name and renamed).
"""

from __future__ import annotations

import argparse
import ast
import csv
import json
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rl360.data import validate_file_schema, validate_row

# Answer-format instructions: each names the format the domain's reward reads.
BOXED = "Please output the final answer within \\boxed{}."
CODE_BLOCK = ("Write a complete Python 3 program or function that solves the task, and give your final code in "
              "one markdown code block: ```python\n# your code\n```")
_LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")


def record_rng(args: argparse.Namespace, index: int) -> random.Random:
    """A random generator for one record, fixed by --seed and the record's index (e.g. to shuffle choices)."""
    return random.Random(f"{args.seed}:{index}")


def answer_tags(example: str) -> str:
    """The instruction to put the final answer inside <answer> … </answer>, with an example of its form."""
    return f"Please put your final answer within <answer> and </answer> tags, for example <answer> {example} </answer>."


class RecordError(ValueError):
    """A source record that cannot be converted; the message names the input file, record and field."""


@dataclass
class Example:
    """One converted record: the chat prompt, the ground truth (a string; a list or dict is JSON-encoded),
    the dataset-specific extra_info fields (keep each field's type the same across records) and, for a
    vision-language prompt, its images as compressed bytes in the order of the prompt's <image> placeholders."""

    prompt: list[dict[str, str]]
    ground_truth: Any
    extra: dict[str, Any] = field(default_factory=dict)
    images: list[bytes] = field(default_factory=list)
    data_source: str | None = None  # this row's own data_source (None: the script's <domain>__<name>)


def user_prompt(text: str, system: str | None = None) -> list[dict[str, str]]:
    """Chat messages: an optional system message, then one user message holding `text`."""
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": text}]


def require(record: dict[str, Any], *keys: str) -> Any:
    """The values of `keys` in `record` (one value for one key, else a tuple); RecordError names a missing key."""
    missing = [key for key in keys if record.get(key) is None]
    if missing:
        raise RecordError(f"missing field(s) {missing}; the record has fields {sorted(record)}")
    values = tuple(record[key] for key in keys)
    return values[0] if len(values) == 1 else values


def parse_literal(value: Any) -> Any:
    """A list or dict given as is, or as JSON text, or as a Python literal (e.g. "['a', 'b']")."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(value.strip())
    except (ValueError, SyntaxError) as err:
        raise RecordError(f"cannot parse {value[:80]!r} as JSON or a Python literal ({err})") from None


def plain_number(value: Any) -> str:
    """An answer value as text, a whole float without its ".0" (1520.0 -> "1520")."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def to_text(value: Any) -> str:
    """A string as is; anything else as JSON text (for ground truths and heterogeneous extra_info values)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


# ----- reading -----------------------------------------------------------------------------------------


def read_records(source: str, split: str = "train", hf_config: str | None = None) -> list[dict[str, Any]]:
    """The records of a local .json (a list of objects, or an object with one such list), .jsonl, .parquet
    or .csv file, or of every such file in a directory (sorted); otherwise `source` is taken as a Hugging Face
    dataset name, loaded with `datasets` (config `hf_config`, split `split`) when that package is installed."""
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in _LOCAL_SUFFIXES)
        if not files:
            raise FileNotFoundError(f"{source}: directory holds no {'/'.join(_LOCAL_SUFFIXES)} files")
        return [record for file in files for record in _read_file(file)]
    if path.is_file():
        return list(_read_file(path))
    try:
        import datasets
    except ImportError:
        raise FileNotFoundError(f"{source}: no such file or directory (a Hugging Face dataset name needs the "
                                "`datasets` package, which is not installed)") from None
    return [dict(record) for record in datasets.load_dataset(source, hf_config, split=split)]


def _read_file(path: Path) -> Iterator[dict[str, Any]]:
    if path.suffix == ".parquet":
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            yield from batch.to_pylist()
    elif path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as err:
                        raise RecordError(f"{path} line {number}: not JSON ({err})") from None
    elif path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict):
            lists = [value for value in data.values() if isinstance(value, list)]
            if len(lists) != 1:
                raise RecordError(f"{path}: a JSON object must hold exactly one list of records, "
                                  f"found keys {sorted(data)}")
            data = lists[0]
        if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
            raise RecordError(f"{path}: expected a JSON list of objects")
        yield from data
    elif path.suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as handle:
            yield from csv.DictReader(handle)
    else:
        raise RecordError(f"{path}: unsupported input type {path.suffix!r}; use one of {_LOCAL_SUFFIXES}")


# ----- rows and writing --------------------------------------------------------------------------------


def make_row(data_source: str, example: Example, split: str, index: int) -> dict[str, Any]:
    """A row of the standard schema from a converted example (with an `images` column of {bytes, path}
    items when the example has images)."""
    data_source = example.data_source or data_source
    row = {
        "data_source": data_source,
        "prompt": example.prompt,
        "ability": data_source.split("__", 1)[0],
        "reward_model": {"style": "rule", "ground_truth": to_text(example.ground_truth)},
        "extra_info": {"split": split, "index": index, **example.extra},
    }
    if example.images:
        row["images"] = [{"bytes": data, "path": None} for data in example.images]
    return row


def write_rows(rows: list[dict[str, Any]], path: Path, row_group_size: int = 256) -> None:
    """Check every row and the resulting schema, then write `rows` to `path` (via a temporary file)."""
    if not rows:
        raise RecordError(f"{path}: no rows to write (every record was left out)")
    for number, row in enumerate(rows):
        validate_row(row, str(path), number)
    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        raise RecordError(f"{path}: rows do not share one schema ({err}); keep each extra_info field's type "
                          "the same in every row") from None
    validate_file_schema(str(path), table.schema)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    pq.write_table(table, partial, row_group_size=row_group_size)
    os.replace(partial, path)


# ----- the command line --------------------------------------------------------------------------------

Converter = Callable[[dict[str, Any], int, argparse.Namespace], "Example | None"]


def base_parser(description: str, name: str) -> argparse.ArgumentParser:
    """The arguments every script takes; a script adds its own to the parser it gets back."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True,
                        help="local .json/.jsonl/.parquet/.csv file or directory (or a Hugging Face dataset name "
                             "when `datasets` is installed)")
    parser.add_argument("--out", default="data", help="output directory; the file is OUT/SPLIT/DATA_SOURCE.parquet")
    parser.add_argument("--split", default="train", help="split label in extra_info (and the Hugging Face split)")
    parser.add_argument("--name", default=name, help="dataset name: data_source is <domain>__<name>")
    parser.add_argument("--hf-config", default=None, help="Hugging Face dataset config, if any")
    parser.add_argument("--sample-size", type=int, default=None, help="keep a seeded random subset of this size")
    parser.add_argument("--seed", type=int, default=0, help="seeds the subset and any per-record shuffling")
    parser.add_argument("--skip-bad", action="store_true",
                        help="skip records that cannot be converted (counted) instead of stopping at the first")
    parser.add_argument("--row-group-size", type=int, default=256, help="rows per parquet row group")
    return parser


def run_script(convert: Converter, *, domain: str, name: str, description: str | None,
               argv: list[str] | None = None,
               add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
               data_source_name: Callable[[argparse.Namespace], str] | None = None) -> Path:
    """Parse `argv`, convert every input record, write OUT/SPLIT/<domain>__<name>.parquet; returns its path.

    `add_arguments` adds the script's own options; `data_source_name(args)` overrides the dataset name
    (e.g. by task) when `--name` was not given.
    """
    parser = base_parser(description or "", name)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    if data_source_name is not None and args.name == name:
        args.name = data_source_name(args)
    data_source = f"{domain}__{args.name}"
    records = read_records(args.input, args.split, args.hf_config)
    indices = range(len(records))
    if args.sample_size is not None and args.sample_size < len(records):
        indices = sorted(random.Random(args.seed).sample(indices, args.sample_size))
    rows, left_out, bad = [], 0, 0
    for index in indices:
        try:
            example = convert(records[index], index, args)
        except (RecordError, KeyError, ValueError, TypeError, IndexError) as err:
            if not args.skip_bad:
                raise RecordError(f"{args.input} record {index}: {type(err).__name__}: {err}") from err
            bad += 1
            continue
        if example is None:
            left_out += 1
            continue
        rows.append(make_row(data_source, example, args.split, index))
    out = Path(args.out) / args.split / f"{data_source}.parquet"
    write_rows(rows, out, args.row_group_size)
    print(f"wrote {len(rows)} rows to {out} ({left_out} records left out by the script's filter, "
          f"{bad} unconvertible records skipped)")
    return out
