"""`rl360 reward check FILE.parquet --responses FILE.jsonl --out SCORES.jsonl`: score saved responses.

The responses file holds one JSON object per parquet row, in row order, each with a `response` string.
Every row is scored by its `data_source` through a `RewardPool` (row group by row group, so a large file
is never loaded whole); SCORES.jsonl gets one JSON object per row: `score`, `timed_out`, `error`
(and `extras`, the reward function's other outputs). The summary printed at the end gives, per domain,
the number of rows, the accuracy (mean score), the timeouts and the errors.

Options: `--workers N` reward processes, `--timeout S` seconds per reward call, `--max-memory-gb G` the
address-space limit of each worker (0: none; an allocation past it is that row's MemoryError),
`--custom PREFIX=module:function` (repeatable) to score data_sources starting with PREFIX with that
function, as the config's `reward.custom` does for training, and `--judge-url URL --judge-model NAME`
for the LLM judge that `stem_web` and `reward_metric=math_llm_judge` rows need (else RL360_JUDGE_URL and
RL360_JUDGE_MODEL from the environment).

Before any scoring, the same data check as at the start of training (`check_reward_data`): every row's
data_source and extra_info.reward_metric must route to a reward function, and a judge must be configured
when one of them needs it; else an error names the file, the first offending row and what is wrong. The
responses file is checked in full too, so a bad line (invalid JSON, no `response`, a line count that
differs from the parquet's row count) stops the command with an error naming the file and line, and no
scores are written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import pyarrow.parquet as pq

from rl360.data.schema import DataError, extra_info_dict
from rl360.data.stream import scan_reward_keys
from rl360.errors import UserError
from rl360.rewards.judge import ENV as JUDGE_ENV
from rl360.rewards.pool import RewardItem, RewardPool, RewardResult, domain_of
from rl360.rewards.registry import (
    JUDGE_SETTING,
    Route,
    RouteError,
    UnknownDataSource,
    check_route,
    register_reward_path,
)


class CheckError(UserError):
    """Bad input to `reward check`; the message names the file (and line or row)."""


@dataclass
class DomainTally:
    """Counts of one domain."""

    rows: int = 0
    score_sum: float = 0.0
    timeouts: int = 0
    errors: int = 0

    @property
    def accuracy(self) -> float:
        return self.score_sum / self.rows if self.rows else 0.0


@dataclass
class CheckSummary:
    """Per-domain counts of a whole check."""

    domains: dict[str, DomainTally] = field(default_factory=dict)

    def add(self, data_source: str, result: RewardResult) -> None:
        tally = self.domains.setdefault(domain_of(data_source), DomainTally())
        tally.rows += 1
        tally.score_sum += result.score
        tally.timeouts += int(result.timed_out)
        tally.errors += int(result.error is not None and not result.timed_out)

    def table(self) -> str:
        """A plain-text table: one line per domain, then the total."""
        lines = [f"{'domain':<20} {'rows':>8} {'accuracy':>9} {'timeouts':>9} {'errors':>7}"]
        total = DomainTally()
        for name in sorted(self.domains):
            tally = self.domains[name]
            lines.append(_row(name, tally))
            total.rows += tally.rows
            total.score_sum += tally.score_sum
            total.timeouts += tally.timeouts
            total.errors += tally.errors
        lines.append(_row("all", total))
        return "\n".join(lines)


def check_reward_data(paths: str | list[str], judge_configured: bool,
                      judge_setting: str = JUDGE_SETTING, on_bad_row: str = "error") -> dict[str, Route]:
    """The data-open check, over every row of the files, before anything starts.

    Rows: each checked with `validate_row` (`scan_bad_rows`, as `rl360 data inspect` counts them): with
    `on_bad_row="error"` any bad row (a null or missing ground_truth, a bad prompt, ...) is a `DataError` naming
    each file with bad rows, their count and first rows, and the first row's error; with "skip" a line says how
    many rows training will skip. Rewards: one scan of the files' data_source and extra_info.reward_metric
    (`scan_reward_keys`), each distinct pair checked with `check_route`. The first offending pair raises
    that `RouteError` (a `KeyError`) with the file, row and number of rows in front: an unknown data_source, a
    reward_metric that no route for it knows (the known ones are listed), a route that needs the LLM judge while
    `judge_configured` is false (`judge_setting` names the setting to fill), or one whose package is missing.
    Returns the route of each pair, keyed by the data_source (followed by " (reward_metric M)" where a row names
    one)."""
    from rl360.data.inspect import scan_bad_rows

    bad, total = scan_bad_rows(paths)
    if bad.count and on_bad_row == "error":
        raise DataError(f"{bad.count} of {total} rows would stop the run when reached: {bad.where()}. The first: "
                        f"{bad.first}. Fix the rows, or set data.on_bad_row=skip to leave them out")
    if bad.count:
        print(f"data: {bad.count} of {total} rows fail the row check and will be skipped (data.on_bad_row=skip): "
              f"{bad.where()}", flush=True)
    keys = scan_reward_keys(paths, count=True)
    found = {}
    for (source, metric), (path, row, _) in keys.items():
        try:
            route = check_route(source, metric, judge_configured, judge_setting)
        except RouteError as err:
            if isinstance(err, UnknownDataSource):  # every row of that data_source, whatever its metric
                same, what = sum(n for (other, _), (_, _, n) in keys.items() if other == source), f"{source!r}"
            else:
                same, what = keys[source, metric][2], f"{source!r} and reward_metric {metric!r}"
            rows = f" (the first of {same} rows with data_source {what})" if same > 1 else ""
            raise type(err)(f"{path} row {row}{rows}: {err}") from None
        found[source if metric is None else f"{source} (reward_metric {metric})"] = route
    return found


def judge_configured(judge_cfg=None, environ: dict[str, str] | None = None) -> bool:
    """Whether reward workers will find a judge endpoint and model: in `judge_cfg` (a `reward.judge` config;
    its empty fields fall back to the environment, as `JudgeClient` does) or in RL360_JUDGE_URL and
    RL360_JUDGE_MODEL."""
    environ = os.environ if environ is None else environ
    url = getattr(judge_cfg, "url", "") or environ.get(JUDGE_ENV["url"], "")
    model = getattr(judge_cfg, "model", "") or environ.get(JUDGE_ENV["model"], "")
    return bool(url.strip() and model.strip())


def check_file(parquet_path: str | Path, responses_path: str | Path, out_path: str | Path,
               num_workers: int = 2, timeout_s: float = 10.0, max_memory_bytes: int | None = None,
               judge_env: dict[str, str] | None = None) -> CheckSummary:
    """Score every row of `parquet_path` with its response from `responses_path`, writing `out_path`;
    `judge_env` (RL360_JUDGE_* variables) configures the LLM judge of the reward workers."""
    parquet = pq.ParquetFile(parquet_path)
    rows = parquet.metadata.num_rows
    for column in ("data_source", "reward_model"):
        if column not in parquet.schema_arrow.names:
            raise CheckError(f"{parquet_path}: missing column {column!r}; the file has {parquet.schema_arrow.names}")
    responses = read_responses(responses_path, rows, parquet_path)
    judge_env = dict(judge_env or {})
    try:
        check_reward_data(str(parquet_path), judge_configured(environ={**os.environ, **judge_env}),
                          "--judge-url and --judge-model (or RL360_JUDGE_URL and RL360_JUDGE_MODEL)")
    except (RouteError, DataError) as err:
        raise CheckError(str(err)) from None
    columns = [c for c in ("data_source", "reward_model", "extra_info") if c in parquet.schema_arrow.names]
    summary = CheckSummary()
    with RewardPool(num_workers=num_workers, timeout_s=timeout_s, max_memory_bytes=max_memory_bytes,
                    env=judge_env) as pool, open(out_path, "w", encoding="utf-8") as out:
        first_row = 0
        for group in range(parquet.num_row_groups):
            items = list(_items(parquet.read_row_group(group, columns=columns).to_pylist(), first_row,
                                responses, parquet_path))
            for item, result in zip(items, pool.score(items)):
                summary.add(item.data_source, result)
                _write(out, result)
            first_row += len(items)
    return summary


def read_responses(path: str | Path, expected_rows: int, parquet_path: str | Path) -> list[str]:
    """The `response` of every line of `path`; `CheckError` naming the file and line for a bad one, or
    when the number of lines is not `expected_rows`."""
    responses: list[str] = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                raise CheckError(f"{path} line {number}: empty line (one JSON object per parquet row expected)")
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise CheckError(f"{path} line {number}: not valid JSON ({err})") from None
            if not isinstance(record, dict) or "response" not in record:
                raise CheckError(f"{path} line {number}: no 'response' key")
            if not isinstance(record["response"], str):
                raise CheckError(f"{path} line {number}: 'response' must be a string, "
                                 f"got {type(record['response']).__name__}")
            responses.append(record["response"])
    if len(responses) != expected_rows:
        where = f"line {expected_rows + 1} is extra" if len(responses) > expected_rows else \
            f"line {len(responses) + 1} is missing"
        raise CheckError(f"{path} has {len(responses)} lines but {parquet_path} has {expected_rows} rows ({where})")
    return responses


def add_reward_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `reward` command group (with `check`) to an argparse subparsers object; returns `reward`."""
    reward = subparsers.add_parser("reward", help="reward tools: score saved responses")
    commands = reward.add_subparsers(dest="reward_command", required=True)
    check = commands.add_parser("check", help="score a responses file against a parquet file's ground truths")
    check.add_argument("parquet", help="prompts with data_source and reward_model.ground_truth")
    check.add_argument("--responses", required=True, help="jsonl, one {\"response\": ...} per parquet row")
    check.add_argument("--out", required=True, help="jsonl written with one {score, timed_out, error} per row")
    check.add_argument("--workers", type=int, default=2, help="reward worker processes (0: in this process)")
    check.add_argument("--timeout", type=float, default=30.0, help="seconds per reward call")
    check.add_argument("--max-memory-gb", type=float, default=0.0,
                       help="address-space limit of each reward worker in GiB (0: none)")
    check.add_argument("--custom", action="append", default=[], type=_custom_reward, metavar="PREFIX=MODULE:FN",
                       help="score data_sources starting with PREFIX with this function (repeatable), "
                            "like reward.custom in the config")
    check.add_argument("--judge-url", default="", help="OpenAI-compatible endpoint of the LLM judge, e.g. "
                       "http://host:8000/v1 (default: $RL360_JUDGE_URL), for stem_web and math_llm_judge rows")
    check.add_argument("--judge-model", default="", help="model name the judge endpoint serves "
                       "(default: $RL360_JUDGE_MODEL)")
    check.set_defaults(run=run_check)
    return reward


def run_check(args: argparse.Namespace, stdout: TextIO | None = None) -> int:
    """Run `reward check` from parsed arguments; 0 on success, 2 on bad input (the error is printed)."""
    stdout = stdout or sys.stdout
    try:
        if args.max_memory_gb < 0:
            raise CheckError(f"--max-memory-gb must be >= 0 (0: no limit), got {args.max_memory_gb:g}")
        for prefix, ref in args.custom:
            try:
                register_reward_path(prefix, ref)
            except (ImportError, AttributeError, TypeError, ValueError) as err:
                raise CheckError(f"--custom {prefix}={ref}: {err}") from None
        judge = {JUDGE_ENV[name]: value for name, value in (("url", args.judge_url), ("model", args.judge_model))
                 if value}
        summary = check_file(args.parquet, args.responses, args.out, num_workers=args.workers,
                             timeout_s=args.timeout, max_memory_bytes=int(args.max_memory_gb * (1 << 30)) or None,
                             judge_env=judge)
    except (CheckError, FileNotFoundError) as err:
        print(f"rl360 reward check: error: {err}", file=sys.stderr)
        return 2
    print(summary.table(), file=stdout)
    print(f"scores written to {args.out}", file=stdout)
    return 0


def _custom_reward(text: str) -> tuple[str, str]:
    """"PREFIX=module:function" as (prefix, reference)."""
    prefix, _, ref = text.partition("=")
    if not prefix or ":" not in ref:
        raise argparse.ArgumentTypeError(f"expected PREFIX=module:function, got {text!r}")
    return prefix, ref


def _items(rows: list[dict], first_row: int, responses: list[str], parquet_path: str | Path) -> Iterator[RewardItem]:
    for offset, row in enumerate(rows):
        index = first_row + offset
        source, reward = row.get("data_source"), row.get("reward_model")
        if not isinstance(reward, dict) or reward.get("ground_truth") is None:
            raise CheckError(f"{parquet_path} row {index}: key 'reward_model.ground_truth' is missing")
        extra = extra_info_dict(row.get("extra_info"))  # as the trainer's data stream gives it
        yield RewardItem(source, responses[index], reward["ground_truth"], extra)


def _write(out: TextIO, result: RewardResult) -> None:
    record = {"score": result.score, "timed_out": result.timed_out, "error": result.error}
    if result.extras:
        record["extras"] = result.extras
    out.write(json.dumps(record, default=str) + "\n")


def _row(name: str, tally: DomainTally) -> str:
    return f"{name:<20} {tally.rows:>8} {tally.accuracy:>9.3f} {tally.timeouts:>9} {tally.errors:>7}"
