"""`rl360 data inspect FILE...`: what a set of prompt parquet files holds.

It prints the rows, the rows per data_source (with their ability), prompt-length percentiles, the images (rows
with images, images per row, their sizes in bytes and pixels, read from the image headers) and the first row of
each data_source (up to --samples) rendered, with its ground truth. Lengths are in tokens of the chat template
with the generation prompt when --tokenizer is given (exactly what PromptRenderer feeds the length filter in
training: for a Qwen2-VL / Qwen2.5-VL model directory, with every image expanded to its tokens), and otherwise
in characters of the message contents, which the output says. Files are read one row group at a time and only
the columns needed, so files larger than memory work.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rl360.data.images import VisionProcessor, header_size, is_vision_model, row_images
from rl360.data.render import PromptRenderer
from rl360.data.schema import DataError, validate_row
from rl360.data.stream import expand_paths, open_parquet

PERCENTILES = (50, 90, 95, 99)
_COLUMNS = ("data_source", "prompt", "reward_model", "ability", "images")
_CHECKED_COLUMNS = ("data_source", "prompt", "reward_model", "images")  # what validate_row reads


@dataclass
class Sample:
    """One row shown in full: where it is, its source, its prompt as the model sees it, its ground truth."""

    path: str
    row: int
    data_source: str
    rendered: str
    ground_truth: str


@dataclass
class BadRows:
    """Rows failing `validate_row` (or, in `rl360 data inspect`, with an unreadable image): how many, where, and
    the message of the first."""

    count: int = 0
    rows: dict[str, list[int]] = field(default_factory=dict)  # path -> indices of its bad rows (the first few)
    per_file: Counter = field(default_factory=Counter)  # path -> bad rows
    first: str | None = None  # the error of the first bad row
    keep: int = 5  # row indices kept per file

    def add(self, path: str, index: int, error: DataError) -> None:
        self.count += 1
        self.per_file[path] += 1
        kept = self.rows.setdefault(path, [])
        if len(kept) < self.keep:
            kept.append(index)
        self.first = self.first or str(error)

    def where(self) -> str:
        """Each file with bad rows: its path, count and first rows, e.g. "a.parquet: 5 rows (3, 9, 12, 40, 41)"."""
        parts = []
        for path, count in self.per_file.items():
            rows = ", ".join(map(str, self.rows[path])) + (", ..." if count > len(self.rows[path]) else "")
            parts.append(f"{path}: {count} row{'s' if count != 1 else ''} ({rows})")
        return "; ".join(parts)


def scan_bad_rows(paths: str | list[str], keep: int = 5) -> tuple[BadRows, int]:
    """Every row of the files checked as `validate_row` checks it (as the prompt stream checks each row it
    reads), read row group by row group with only the columns it looks at: the bad rows (`keep` indices per
    file) and the number of rows.

    Columnar: pyarrow compute finds the rows that certainly pass (`_suspect_rows`); only the others are turned
    into Python values and given to `validate_row`, whose message names the row."""
    bad, total = BadRows(keep=keep), 0
    for path in expand_paths(paths):
        handle = open_parquet(path)
        try:
            columns = [name for name in _CHECKED_COLUMNS if name in handle.schema_arrow.names]
            index = 0  # within the file, as the stream's errors count
            for group in range(handle.num_row_groups):
                table = _read_table(handle, path, group, columns)
                suspects = _suspect_rows(table)
                rows = table.take(pa.array(suspects, pa.int64())).to_pylist() if suspects else []
                for offset, row in zip(suspects, rows):
                    try:
                        validate_row(row, path, index + offset)
                    except DataError as err:
                        bad.add(path, index + offset, err)
                index += table.num_rows
            total += index
        finally:
            handle.close()
    return bad, total


def _suspect_rows(table: pa.Table) -> list[int]:
    """Indices of the rows of `table` that `validate_row` might refuse: every row unless each column it reads
    has the usual type (prompt a list of structs with string role and content, data_source a string,
    reward_model a struct with ground_truth); then the rows where a value is null or empty, or with images."""
    n = table.num_rows
    names = table.column_names
    if not {"prompt", "data_source", "reward_model"} <= set(names):
        return list(range(n))
    prompt, source, reward = (table.column(name).combine_chunks()
                              for name in ("prompt", "data_source", "reward_model"))
    message = prompt.type.value_type if pa.types.is_list(prompt.type) or pa.types.is_large_list(prompt.type) else None
    usual = message is not None and pa.types.is_struct(message) \
        and all(message.get_field_index(key) >= 0 and pa.types.is_string(message.field(key).type)
                for key in ("role", "content")) \
        and pa.types.is_string(source.type) \
        and pa.types.is_struct(reward.type) and reward.type.get_field_index("ground_truth") >= 0
    if not usual:
        return list(range(n))
    ok = pc.and_(pc.is_valid(prompt), pc.greater(pc.fill_null(pc.list_value_length(prompt), 0), 0))
    ok = pc.and_(ok, pc.and_(pc.is_valid(source), pc.greater(pc.fill_null(pc.utf8_length(source), 0), 0)))
    truth = pc.struct_field(reward, "ground_truth")
    ok = pc.and_(ok, pc.and_(pc.is_valid(reward), pc.is_valid(truth)))
    if "images" in names:
        ok = pc.and_(ok, pc.is_null(table.column("images").combine_chunks()))
    messages = prompt.flatten()  # one per message, with the row each belongs to
    message_ok = pc.and_(pc.is_valid(messages), pc.and_(pc.is_valid(pc.struct_field(messages, "role")),
                                                        pc.is_valid(pc.struct_field(messages, "content"))))
    if pc.all(message_ok).as_py() not in (True, None):
        parents = pc.list_parent_indices(prompt)
        bad_parents = pc.filter(parents, pc.invert(message_ok)).to_numpy()
        ok = pc.and_(ok, pc.invert(pc.is_in(pa.array(range(n), pa.int64()), value_set=pa.array(bad_parents))))
    return pc.indices_nonzero(pc.invert(ok)).to_pylist()


@dataclass
class Inspection:
    """What `inspect_files` found."""

    files: dict[str, int]  # path -> rows
    per_source: Counter = field(default_factory=Counter)  # data_source -> rows
    abilities: dict[str, Counter] = field(default_factory=dict)  # data_source -> ability -> rows
    lengths: list[int] = field(default_factory=list)  # one per row with a valid prompt
    unit: str = "characters"  # "tokens" with a tokenizer
    bad: BadRows = field(default_factory=BadRows)
    samples: list[Sample] = field(default_factory=list)
    images_per_row: list[int] = field(default_factory=list)  # one per valid row with images
    image_bytes: list[int] = field(default_factory=list)  # one per image: compressed size
    image_widths: list[int] = field(default_factory=list)  # one per image, from its header
    image_heights: list[int] = field(default_factory=list)
    images_expanded: bool = False  # token lengths count each image's tokens (a vision-language model)

    @property
    def rows(self) -> int:
        return sum(self.files.values())

    @property
    def bad_rows(self) -> int:
        return self.bad.count

    @property
    def first_bad(self) -> str | None:
        return self.bad.first


def inspect_files(paths: str | list[str], tokenizer: Any = None, samples: int = 3,
                  vision: VisionProcessor | None = None) -> Inspection:
    """Read the files (paths, directories or globs) row group by row group and gather an `Inspection`; with a
    `vision` processor, token lengths count each image's tokens."""
    renderer = PromptRenderer(tokenizer, max_prompt_length=sys.maxsize, vision=vision) \
        if tokenizer is not None else None
    found = Inspection(files={}, unit="tokens" if renderer else "characters", images_expanded=vision is not None)
    for path in expand_paths(paths):
        handle = open_parquet(path)
        try:
            columns = [name for name in _COLUMNS if name in handle.schema_arrow.names]
            first_row = 0
            for group in range(handle.num_row_groups):
                rows = _read_rows(handle, path, group, columns)
                for offset, row in enumerate(rows):
                    _add_row(found, row, path, first_row + offset, renderer, samples)
                first_row += len(rows)
            found.files[path] = first_row
        finally:
            handle.close()
    return found


def _read_rows(handle: Any, path: str, group: int, columns: list[str]) -> list[dict[str, Any]]:
    return _read_table(handle, path, group, columns).to_pylist()


def _read_table(handle: Any, path: str, group: int, columns: list[str]) -> pa.Table:
    try:
        return handle.read_row_group(group, columns=columns)
    except (pa.ArrowException, OSError, ValueError) as err:
        raise DataError(f"{path}: row group {group} cannot be read ({type(err).__name__}: {err})") from None


def _add_row(found: Inspection, row: dict[str, Any], path: str, index: int, renderer: PromptRenderer | None,
             samples: int) -> None:
    source = row.get("data_source") if isinstance(row.get("data_source"), str) else "<missing>"
    found.per_source[source] += 1
    found.abilities.setdefault(source, Counter())[str(row.get("ability") or "-")] += 1
    row["_source"] = {"file": path, "row": index}
    try:
        validate_row(row, path, index)
        images = row_images(row)
        sizes = [header_size(data, f"{path} row {index}: key 'images'[{number}]") for number, data in enumerate(images)]
        ids = _token_ids(renderer, row, images) if renderer is not None else None
    except DataError as err:
        found.bad.add(path, index, err)
        return
    if images:
        found.images_per_row.append(len(images))
        found.image_bytes += [len(data) for data in images]
        found.image_widths += [width for width, _ in sizes]
        found.image_heights += [height for _, height in sizes]
    messages = row["prompt"]
    found.lengths.append(len(ids) if ids is not None else sum(len(message["content"]) for message in messages))
    if len(found.samples) < samples and all(sample.data_source != source for sample in found.samples):
        rendered = _decoded(renderer, ids) if renderer is not None else _plain(messages)
        found.samples.append(Sample(path, index, source, rendered, str(row["reward_model"]["ground_truth"])))


def _token_ids(renderer: PromptRenderer, row: dict[str, Any], images: tuple[bytes, ...]) -> list[int]:
    """The row's prompt ids: with its images' tokens for a vision model, the text's alone otherwise."""
    return renderer.prompt(row).ids if images and renderer.vision is not None else renderer.render(row["prompt"])


def _decoded(renderer: PromptRenderer, ids: list[int]) -> str:
    """The ids as text, each run of image tokens shown once with its length ("<|image_pad|>x16")."""
    if renderer.vision is None:
        return renderer.tokenizer.decode(ids)
    pad = renderer.vision.image_token_id
    runs = itertools.groupby(ids, key=lambda token: token == pad)
    return "".join(f"{renderer.vision.image_token}x{len(list(run))}" if is_pad else renderer.tokenizer.decode(list(run))
                   for is_pad, run in runs)


def _plain(messages: list[dict[str, Any]]) -> str:
    return "\n".join(f"[{message['role']}]\n{message['content']}" for message in messages)


def percentile(sorted_values: list[int], q: float) -> int:
    """The nearest-rank q-th percentile of already sorted values."""
    return sorted_values[max(0, math.ceil(q / 100 * len(sorted_values)) - 1)]


def format_report(found: Inspection, tokenizer_name: str | None = None, max_chars: int = 1500,
                  max_prompt_length: int | None = None, reward_of: Any = None) -> str:
    """The human-readable report of an inspection; with `reward_of`, each data_source's reward function and the
    data_sources no reward function serves."""
    lines = [f"{len(found.files)} file(s), {found.rows} rows"]
    lines += [f"  {path}: {rows} rows" for path, rows in found.files.items()]
    width = max([len("data_source")] + [len(source) for source in found.per_source])
    rewards = {source: reward_of(source) for source in found.per_source} if reward_of else {}
    lines += ["", f"rows per data_source ({len(found.per_source)}):",
              f"  {'data_source':<{width}}  {'rows':>9}  {'share':>6}  ability" + ("  (reward)" if rewards else "")]
    for source, count in sorted(found.per_source.items(), key=lambda item: (-item[1], item[0])):
        abilities = ", ".join(name for name, _ in found.abilities[source].most_common())
        scorer = f"  ({rewards[source] or 'NO REWARD FUNCTION'})" if rewards else ""
        lines.append(f"  {source:<{width}}  {count:>9}  {100 * count / found.rows:>5.1f}%  {abilities}{scorer}")
    unserved = sorted(source for source, ref in rewards.items() if ref is None)
    if unserved:
        lines.append(f"no reward function serves {len(unserved)} data_source(s): {', '.join(unserved)}; `rl360 train` "
                     "refuses them: register one (reward.custom, docs/reward-setup.md)")
    lines.append("")
    if found.unit == "tokens":
        lines.append(f"prompt length in tokens (chat template of {tokenizer_name}, with the generation prompt):")
    else:
        lines.append("prompt length in characters of the message contents (no --tokenizer given, so not tokens):")
    if found.lengths:
        values = sorted(found.lengths)
        parts = [f"min {values[0]}"] + [f"p{q} {percentile(values, q)}" for q in PERCENTILES]
        parts += [f"max {values[-1]}", f"mean {sum(values) / len(values):.1f}"]
        lines.append("  " + "  ".join(parts))
        if max_prompt_length is not None:
            over = sum(length > max_prompt_length for length in values)
            share = 100 * over / len(values)
            lines.append(f"  longer than {max_prompt_length} {found.unit}: {over} rows ({share:.1f}%)")
    else:
        lines.append("  (no row with a valid prompt)")
    lines += _image_lines(found)
    lines.append(f"bad rows (failing validate_row or with an unreadable image): {found.bad_rows}"
                 + (f" ({found.bad.where()}); the first: {found.first_bad}" if found.first_bad else ""))
    if found.samples:
        how = "rendered with the chat template" if found.unit == "tokens" else "messages as stored"
        lines += ["", f"samples (the first row of each data_source, {how}):"]
    for number, sample in enumerate(found.samples, start=1):
        lines += [f"--- sample {number}: {sample.data_source}, {sample.path} row {sample.row}",
                  _clip(sample.rendered, max_chars), f"--- ground truth: {_clip(sample.ground_truth, max_chars)}"]
    return "\n".join(lines)


def _image_lines(found: Inspection) -> list[str]:
    """Rows with images, images per such row, and the images' sizes (bytes; pixels from the headers)."""
    if not found.images_per_row:
        return ["images: none"]
    per_row, valid = found.images_per_row, len(found.lengths)
    lines = [f"images: {len(per_row)} of {valid} valid rows have images ({100 * len(per_row) / valid:.1f}%), "
             f"{len(found.image_bytes)} images; per such row min {min(per_row)}  "
             f"mean {sum(per_row) / len(per_row):.2f}  max {max(per_row)}"]
    for name, values, show in (("bytes", found.image_bytes, _size), ("width (px)", found.image_widths, str),
                               ("height (px)", found.image_heights, str)):
        ordered = sorted(values)
        lines.append(f"  {name}: min {show(ordered[0])}  median {show(percentile(ordered, 50))}  "
                     f"max {show(ordered[-1])}")
    if found.unit == "tokens":
        lines.append("  (prompt lengths above count each image's tokens)" if found.images_expanded else
                     "  (prompt lengths above count text tokens only: the tokenizer is not a vision-language model)")
    return lines


def _size(count: int) -> str:
    """A byte count in B, KiB, MiB or GiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


# ----- command line ---------------------------------------------------------------------------------------


def add_inspect_parser(subparsers: argparse._SubParsersAction,
                       reward_of: Any = None) -> argparse.ArgumentParser:
    """Add the `inspect` command to a subparsers group (`rl360 data inspect`); `reward_of(data_source)` names the
    reward function that scores a data_source (None: none does), for the report's reward column."""
    parser = subparsers.add_parser("inspect", help="rows, data_sources, prompt lengths and samples of parquet files",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="parquet files, directories or globs")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer (or model) directory: prompt lengths in tokens of its chat template (a "
                             "Qwen2-VL / Qwen2.5-VL model directory counts each image's tokens too)")
    parser.add_argument("--samples", type=int, default=3, help="data_sources to show a sample row of")
    parser.add_argument("--max-chars", type=int, default=1500, help="characters of each sample shown")
    parser.add_argument("--max-prompt-length", type=int, default=None,
                        help="also count the prompts longer than this (e.g. data.max_prompt_length)")
    parser.set_defaults(run=run_inspect, reward_of=reward_of)
    return parser


def run_inspect(args: argparse.Namespace) -> int:
    """Run `rl360 data inspect` with parsed arguments; prints the report and returns the exit status."""
    tokenizer = vision = None
    try:
        if args.tokenizer is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
            if is_vision_model(args.tokenizer):
                vision = VisionProcessor.from_pretrained(args.tokenizer, tokenizer)
        found = inspect_files(args.files, tokenizer, samples=args.samples, vision=vision)
    except DataError as err:
        print(f"rl360: data error: {err}", file=sys.stderr)
        return 2
    print(format_report(found, args.tokenizer, args.max_chars, args.max_prompt_length,
                        getattr(args, "reward_of", None)))
    return 0
