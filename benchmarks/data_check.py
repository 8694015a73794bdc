"""The data check `rl360 train` runs before Ray starts, timed against reading the columns it needs.

    python benchmarks/data_check.py [--gb 2] [--path /tmp/rl360_data_check.parquet] [--keep] [--out FILE]

Writes (or reuses, when it is there with the same size asked) a parquet file of about `--gb` GB in the
verl / Reasoning360 schema (`data_source`, `prompt` as chat messages, `ability`, `reward_model` with a
`ground_truth`, `extra_info`), row groups of 20,000 rows, whose last row has a null ground truth. Then it
times, on a warm page cache (one untimed read first):

- `read columns`: pyarrow reading, row group by row group, only the columns the check needs
  (`data_source`, `prompt`, `reward_model`, `extra_info`);
- `check`: `rl360.rewards.check.check_reward_data` (every row's prompt, data_source route and ground truth,
  as `rl360 train` runs it), which must refuse the file naming the file and the last row.

Prints both and their ratio (the bar: the check under 2x reading the columns) and writes them with the
command and the machine to `--out` (benchmarks/results/data_check.json). The file is deleted afterwards
unless `--keep`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROWS_PER_GROUP = 20_000
SOURCES = ["math__deepscaler", "codegen__leetcode2k", "logic__zebra_puzzle_dataset", "simulation__codeio",
           "table__hitab", "stem__webinstruct", "openai/gsm8k", "ordering_puzzle_dataset"]
COLUMNS = ["data_source", "prompt", "reward_model", "extra_info"]


def _pool(rng: np.random.Generator, size: int = ROWS_PER_GROUP) -> pa.Array:
    """`size` distinct prompts of about 1,500 characters of random words."""
    words = np.array(["".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(2, 10))) for _ in range(50_000)])
    lengths = rng.integers(150, 350, size)
    picks = rng.integers(0, len(words), int(lengths.sum()))
    cuts = np.concatenate([[0], np.cumsum(lengths)])
    return pa.array([" ".join(words[picks[a:b]]) + " Put the final answer in \\boxed{}."
                     for a, b in zip(cuts[:-1], cuts[1:])])


def _group(rng: np.random.Generator, pool: pa.Array, first: int, last_truth_null: bool) -> pa.Table:
    """One row group of Reasoning360-schema rows: the pool's prompts in a fresh order, built column by column."""
    n = ROWS_PER_GROUP
    contents = pool.take(pa.array(rng.permutation(len(pool))[:n]))
    messages = pa.StructArray.from_arrays([pa.array(["user"] * n), contents], names=["role", "content"])
    prompt = pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32)), messages)
    truths = pc.cast(pa.array(rng.integers(0, 10_000, n)), pa.string())
    if last_truth_null:
        truths = pa.concat_arrays([truths.slice(0, n - 1), pa.nulls(1, pa.string())])
    reward = pa.StructArray.from_arrays([pa.array(["rule"] * n), truths], names=["style", "ground_truth"])
    extra = pa.StructArray.from_arrays([pa.array(["train"] * n), pa.array(np.arange(first, first + n))],
                                       names=["split", "index"])
    sources = pa.array(SOURCES).take(pa.array(rng.integers(0, len(SOURCES), n)))
    return pa.table({"data_source": sources, "prompt": prompt, "ability": pa.array(["math"] * n),
                     "reward_model": reward, "extra_info": extra})


def write_file(path: Path, gb: float) -> tuple[int, int]:
    """Write the file; (rows, bytes)."""
    rng = np.random.default_rng(0)
    pool = _pool(rng)
    target = gb * 1e9
    rows = 0
    tmp = path.with_suffix(".partial")
    writer = None
    try:
        while True:
            size = tmp.stat().st_size if tmp.exists() else 0
            last = rows > 0 and size + (size / rows) * ROWS_PER_GROUP >= target
            group = _group(rng, pool, rows, last)
            if writer is None:
                writer = pq.ParquetWriter(tmp, group.schema)
            writer.write_table(group, row_group_size=ROWS_PER_GROUP)
            rows += ROWS_PER_GROUP
            if last:
                break
    finally:
        if writer is not None:
            writer.close()
    tmp.rename(path)
    return rows, path.stat().st_size


def read_columns(path: Path) -> int:
    handle = pq.ParquetFile(path)
    rows = 0
    for group in range(handle.num_row_groups):
        rows += handle.read_row_group(group, columns=COLUMNS).num_rows
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--path", default="/tmp/rl360_data_check.parquet")
    parser.add_argument("--keep", action="store_true", help="keep the parquet file")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "data_check.json"))
    args = parser.parse_args(argv)
    from rl360.errors import UserError
    from rl360.rewards.check import check_reward_data

    path = Path(args.path)
    meta = Path(str(path) + ".json")
    if not (path.exists() and meta.exists() and json.loads(meta.read_text()).get("gb") == args.gb):
        began = time.perf_counter()
        rows, size = write_file(path, args.gb)
        meta.write_text(json.dumps({"gb": args.gb, "rows": rows}))
        print(f"wrote {path}: {rows:,} rows, {size / 1e9:.2f} GB in {time.perf_counter() - began:.0f} s", flush=True)
    rows = json.loads(meta.read_text())["rows"]
    try:
        read_columns(path)  # warm the page cache: both timings read from memory
        began = time.perf_counter()
        read_columns(path)
        read_s = time.perf_counter() - began
        began = time.perf_counter()
        try:
            check_reward_data([str(path)], judge_configured=False)
            refused = None
        except UserError as err:
            refused = str(err)
        check_s = time.perf_counter() - began
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)
            meta.unlink(missing_ok=True)
    expected = f"{path} row {rows - 1}: key 'reward_model.ground_truth' is missing"
    named = refused is not None and expected in refused
    result = {
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "machine": f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                   f"load average {os.getloadavg()[0]:.1f} at the end",
        "file_gb": round(os.path.getsize(path) / 1e9, 3) if path.exists() else args.gb,
        "rows": rows,
        "read_columns_s": round(read_s, 2),
        "check_s": round(check_s, 2),
        "ratio": round(check_s / read_s, 2),
        "bar": "check < 2 x read_columns",
        "refused_naming_file_and_row": named,
        "message": (refused or "")[:300],
    }
    print(f"read {', '.join(COLUMNS)}: {read_s:.2f} s; check_reward_data: {check_s:.2f} s; ratio {result['ratio']:.2f} "
          f"(bar < 2); refused naming file and row: {named}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if named else 1


if __name__ == "__main__":
    sys.exit(main())
