"""Peak memory of streaming a large parquet prompt file with PromptStream, against reading it whole.

    .venv/bin/python benchmarks/data_stream.py --size-gb 2

Writes a parquet file of at least --size-gb GB (10^9 bytes) on disk in the standard schema: rows with a
system message and a long user message of random base64 text (so compression cannot shrink it), written one
row group at a time, so the file is never held in memory. Then two child processes each measure their own
peak resident memory (VmHWM in /proc/self/status, reset through /proc/self/clear_refs after the imports):

- stream: PromptStream over the file with the training defaults (seeded shuffle, shuffle buffer of 1024
  rows), every row of one epoch in batches;
- whole (the baseline): pandas.read_parquet when pandas is installed, otherwise
  pyarrow.parquet.read_table(path).to_pylist(), which also turns every row into Python objects.

It prints each growth (peak minus the resident size before the work) and wall time side by side, and their
ratio. The temporary directory is deleted at the end.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
SOURCES = ("math__bench", "codegen__bench", "logic__bench")


def write_file(path: Path, size_bytes: int, prompt_chars: int, row_group_size: int) -> int:
    """Write whole row groups of `row_group_size` rows, one at a time, until their text reaches `size_bytes`
    (random base64 does not compress, so the file is at least that large); returns the rows written."""
    groups = -(-size_bytes // (prompt_chars * row_group_size))  # ceiling division
    with pq.ParquetWriter(path, _schema()) as writer:
        for group in range(groups):
            rows = _rows(group * row_group_size, row_group_size, prompt_chars)
            writer.write_table(pa.Table.from_pylist(rows, schema=_schema()), row_group_size=row_group_size)
    if path.stat().st_size < size_bytes:
        raise RuntimeError(f"{path} has {path.stat().st_size} bytes, less than the {size_bytes} asked for")
    return groups * row_group_size


def _schema() -> pa.Schema:
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(message)),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
    ])


def _rows(start: int, count: int, prompt_chars: int) -> list[dict]:
    raw = os.urandom(count * prompt_chars * 3 // 4 + 3)
    text = base64.b64encode(raw).decode("ascii")
    rows = []
    for offset in range(count):
        index = start + offset
        source = SOURCES[index % len(SOURCES)]
        body = text[offset * prompt_chars:(offset + 1) * prompt_chars]
        rows.append({
            "data_source": source,
            "prompt": [{"role": "system", "content": "Answer the question; put the answer in \\boxed{}."},
                       {"role": "user", "content": f"Question {index}: {body}"}],
            "ability": source.split("__")[0],
            "reward_model": {"style": "rule", "ground_truth": str(index)},
            "extra_info": {"split": "train", "index": index},
        })
    return rows


# ----- the measured work, in a child process --------------------------------------------------------------


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def _reset_peak() -> bool:
    """Reset VmHWM to the current resident size (Linux >= 4.0); False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def child(mode: str, path: str, batch_size: int, shuffle_buffer: int) -> dict:
    sys.path.insert(0, str(REPO))
    from rl360.data import PromptStream

    use_pandas = importlib.util.find_spec("pandas") is not None
    if use_pandas:
        import pandas
    reset = _reset_peak()
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    if mode == "stream":
        stream = PromptStream(path, batch_size, seed=0, shuffle_buffer=shuffle_buffer, drop_last=False)
        rows = chars = 0
        while rows < stream.num_rows:
            for row in next(stream):
                rows += 1
                chars += len(row["prompt"][-1]["content"])
        stream.close()
        what = f"PromptStream (batch {batch_size}, shuffle buffer {shuffle_buffer})"
    elif use_pandas:
        frame = pandas.read_parquet(path)
        rows, chars = len(frame), int(frame["prompt"].map(lambda p: len(p[-1]["content"])).sum())
        what = "pandas.read_parquet"
    else:
        records = pq.read_table(path).to_pylist()
        rows, chars = len(records), sum(len(r["prompt"][-1]["content"]) for r in records)
        what = "pyarrow read_table().to_pylist()"
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    return {"what": what, "rows": rows, "chars": chars, "growth_kib": peak - before, "before_kib": before,
            "peak_reset": reset, "seconds": seconds}


def _measure(mode: str, path: Path, args: argparse.Namespace) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", mode, "--path", str(path),
                           "--batch-size", str(args.batch_size), "--shuffle-buffer", str(args.shuffle_buffer)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {mode} child failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0, help="least size of the file on disk, in 10^9 bytes")
    parser.add_argument("--prompt-chars", type=int, default=16384, help="characters of each user message")
    parser.add_argument("--row-group-size", type=int, default=256, help="rows per parquet row group")
    parser.add_argument("--batch-size", type=int, default=256, help="PromptStream batch size")
    parser.add_argument("--shuffle-buffer", type=int, default=1024, help="PromptStream shuffle buffer (rows)")
    parser.add_argument("--tmpdir", default=None, help="where to write the file (default: the system temp dir)")
    parser.add_argument("--child", choices=["stream", "whole"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.path, args.batch_size, args.shuffle_buffer)))
        return

    with tempfile.TemporaryDirectory(prefix="rl360-bench-", dir=args.tmpdir) as tmp:
        path = Path(tmp) / "prompts.parquet"
        start = time.perf_counter()
        rows = write_file(path, int(args.size_gb * 1e9), args.prompt_chars, args.row_group_size)
        size = path.stat().st_size
        groups = pq.ParquetFile(path).num_row_groups
        print(f"wrote {path}: {size / 1e9:.2f} GB on disk, {rows} rows in {groups} row groups of "
              f"{args.row_group_size}, user messages of {args.prompt_chars} characters "
              f"({time.perf_counter() - start:.0f} s)")
        stream, whole = _measure("stream", path, args), _measure("whole", path, args)
    for result in (stream, whole):
        if result["rows"] != rows or not result["peak_reset"]:
            print(f"note: {result['what']} read {result['rows']} rows of {rows}; peak reset: {result['peak_reset']}")
    print(f"\n{'':60}  {'peak RSS growth':>14}  {'wall time':>10}")
    for label, result in (("stream: " + stream["what"], stream), ("whole: " + whole["what"], whole)):
        print(f"{label:<60}  {result['growth_kib'] / 1024:>10.0f} MiB  {result['seconds']:>8.1f} s")
    ratio = whole["growth_kib"] / max(stream["growth_kib"], 1)
    print(f"\nreading whole takes {ratio:.1f}x the memory growth of streaming "
          f"({whole['growth_kib'] / 1024:.0f} MiB vs {stream['growth_kib'] / 1024:.0f} MiB for a "
          f"{size / 1e9:.2f} GB file); the temporary file is deleted")


if __name__ == "__main__":
    main()
