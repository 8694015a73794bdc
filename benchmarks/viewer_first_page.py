"""`rl360 view` on a ~1 GB parquet file: the first page in a cold viewer process against reading the file whole.

    python benchmarks/viewer_first_page.py [--gb 1] [--cache DIR] [--out FILE]

Writes (or reuses, under `--cache`, default ~/.cache/rl360/benchmarks) a parquet file of about `--gb` GB in the
verl / Reasoning360 schema (`data_source`, `prompt` as chat messages of ~1,500 characters, `ability`,
`reward_model`, `extra_info`; row groups of 20,000 rows: benchmarks/data_check.py's writer). With the file in
the page cache (read once first), it starts `rl360 view FILE --port 0` and times:

- `first page`: from the banner, the page as a browser loads it: `/` (HTML), `/static/viewer.js`,
  `/static/viewer.css`, `/api/info`, `/api/rows?offset=0&limit=50` (the viewer's first API calls, nothing
  read before them);
- `read whole`: `pyarrow.parquet.read_table(FILE)`, the file read whole (the baseline);

and, apart, a page in the middle of the file (inside a row group: that whole group decoded) and the first
`data_source`-filtered page (a scan of that column). Prints them and the ratio; the bar: the first page under
2 s. Writes the figures with the command and the machine to `--out` (benchmarks/results/viewer_first_page.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_check import SOURCES, write_file  # noqa: E402  (the benchmarks' realistic-rows writer)

ROOT = Path(__file__).resolve().parents[1]
BAR_S = 2.0


def _timed_get(client: httpx.Client, url: str, **params) -> tuple[float, httpx.Response]:
    began = time.perf_counter()
    reply = client.get(url, params=params)
    reply.raise_for_status()
    return time.perf_counter() - began, reply


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "rl360" / "benchmarks"))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "viewer_first_page.json"))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from rl360.serve.loadgen import start_service, stop_service

    path = Path(args.cache) / f"viewer_rows_{args.gb:g}gb.parquet"
    meta = Path(str(path) + ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    if not (path.exists() and meta.exists()):
        began = time.perf_counter()
        rows, size = write_file(path, args.gb)
        meta.write_text(json.dumps({"gb": args.gb, "rows": rows}))
        print(f"wrote {path}: {rows:,} rows, {size / 1e9:.2f} GB in {time.perf_counter() - began:.0f} s", flush=True)
    rows = json.loads(meta.read_text())["rows"]
    with open(path, "rb") as handle:  # into the page cache: both timings read from memory
        while handle.read(64 << 20):
            pass

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    began = time.perf_counter()
    proc, url = start_service([sys.executable, "-m", "rl360.cli", "view", str(path), "--port", "0"], env=env,
                              timeout_s=300)
    startup_s = time.perf_counter() - began
    try:
        with httpx.Client(timeout=120) as client:
            began = time.perf_counter()
            for route in ("/", "/static/viewer.js", "/static/viewer.css", "/api/info"):
                _timed_get(client, url + route)
            rows_s, first = _timed_get(client, url + "/api/rows", offset=0, limit=50)
            first_page_s = time.perf_counter() - began
            assert [r["index"] for r in first.json()["rows"]] == list(range(50))
            middle = rows // 2 + 10_777  # inside a row group, past its first batch: the whole group is decoded
            middle_s, _ = _timed_get(client, url + "/api/rows", offset=middle, limit=50)
            filtered_s, filtered = _timed_get(client, url + "/api/rows", offset=0, limit=50, data_source=SOURCES[2])
            filtered_total = filtered.json()["total"]
    finally:
        stop_service(proc)

    began = time.perf_counter()
    whole = pq.read_table(path)
    read_whole_s = time.perf_counter() - began
    assert whole.num_rows == rows
    del whole

    ratio = read_whole_s / first_page_s
    print(f"file: {path.stat().st_size / 1e9:.2f} GB, {rows:,} rows, {pq.ParquetFile(path).num_row_groups} row groups")
    print(f"viewer process start (to its banner): {startup_s:.2f} s")
    print(f"first page (HTML, script, style, /api/info, /api/rows 50 rows): {first_page_s:.3f} s "
          f"(of which /api/rows {rows_s:.3f} s)")
    print(f"read whole (pyarrow.parquet.read_table): {read_whole_s:.2f} s")
    print(f"ratio read whole / first page: {ratio:.1f}x; bar: first page < {BAR_S:g} s: "
          f"{'met' if first_page_s < BAR_S else 'NOT met'}")
    print(f"a page in the middle (offset {middle:,}): {middle_s:.3f} s; first filtered page (data_source={SOURCES[2]}, "
          f"{filtered_total:,} rows): {filtered_s:.2f} s")
    result = {
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "machine": f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                   f"load average {os.getloadavg()[0]:.1f} at the end",
        "file_gb": round(path.stat().st_size / 1e9, 2), "rows": rows,
        "row_groups": pq.ParquetFile(path).num_row_groups,
        "viewer_start_s": round(startup_s, 2), "first_page_s": round(first_page_s, 3),
        "first_api_rows_s": round(rows_s, 3), "read_whole_s": round(read_whole_s, 2), "ratio": round(ratio, 1),
        "middle_page_s": round(middle_s, 3), "first_filtered_page_s": round(filtered_s, 2),
        "bar": f"first page < {BAR_S:g} s", "bar_met": first_page_s < BAR_S,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if first_page_s < BAR_S else 1


if __name__ == "__main__":
    sys.exit(main())
