"""A run directory's dumped rollouts (`<run>/rollouts/step_*.jsonl`, written by `trainer.dump_rollouts_every`:
rl360/tracking/rollout_dump.py) as viewer rows, one per trajectory, steps in order, and a few curves of
`<run>/metrics.jsonl`.

Opening indexes every line once (its file, byte offset and the fields the list and filters need); a row's
detail reads only its own line again."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl360.errors import UserError
from rl360.tracking.rollout_dump import ROLLOUT_DIR
from rl360.view.values import jsonable, preview

METRICS_FILE = "metrics.jsonl"
CURVE_KEYS = ("reward/mean", "response_length/mean", "rollout/logprob_abs_diff", "actor/kl", "actor/pg_loss")
OUTCOMES = ["right", "wrong"]  # score >= 1, score < 1
COLUMNS = ["step", "data_source", "score", "response_length", "finish_reason", "logprob_diff_mean", "prompt",
           "response"]
_STEP_FILE = re.compile(r"step_(\d+)\.jsonl$")


@dataclass(frozen=True)
class _Line:
    file: Path
    offset: int
    step: int
    data_source: str
    score: float
    summary: dict[str, Any]


class RolloutSource:
    kind = "rollouts"

    def __init__(self, run_dir: Path):
        self.path = run_dir
        files = sorted((int(m.group(1)), p) for p in (run_dir / ROLLOUT_DIR).glob("step_*.jsonl")
                       if (m := _STEP_FILE.search(p.name)))
        if not files:
            raise UserError(f"{run_dir / ROLLOUT_DIR} holds no step_*.jsonl files; train with "
                            "trainer.dump_rollouts_every=N to write them")
        self.lines: list[_Line] = []
        for step, file in files:
            self.lines += _index(file, step)
        self.steps = [str(step) for step, _ in files]
        self.sources = sorted({line.data_source for line in self.lines})

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": str(self.path), "total": len(self.lines), "columns": COLUMNS,
                "summary": {"steps": len(self.steps), "trajectories": len(self.lines)},
                "curve": (self.path / METRICS_FILE).is_file()}

    def filters(self, scan: bool = True) -> list[dict[str, Any]]:
        return [{"name": "step", "options": self.steps}, {"name": "data_source", "options": self.sources},
                {"name": "outcome", "options": OUTCOMES}]

    def page(self, offset: int, limit: int, chosen: dict[str, str]) -> dict[str, Any]:
        step, source, outcome = chosen.get("step"), chosen.get("data_source"), chosen.get("outcome")
        matched = [i for i, line in enumerate(self.lines)
                   if (not step or line.step == int(step)) and (not source or line.data_source == source)
                   and (not outcome or (line.score >= 1.0) == (outcome == "right"))]
        rows = [{"index": i, **self.lines[i].summary} for i in matched[offset:offset + limit]]
        return {"total": len(matched), "rows": rows}

    def row(self, index: int) -> dict[str, Any]:
        line = self.lines[index]
        with open(line.file, "rb") as handle:
            handle.seek(line.offset)
            record = json.loads(handle.readline())
        return {"index": index, "step": line.step, "fields": jsonable(record, inline_images=True)}

    def curve(self) -> dict[str, Any]:
        """`step` and the values of the CURVE_KEYS present in metrics.jsonl (null where a step lacks one)."""
        path = self.path / METRICS_FILE
        records = []
        if path.is_file():
            for raw in path.read_text(encoding="utf-8").splitlines():
                try:
                    records.append(json.loads(raw))
                except json.JSONDecodeError:
                    continue  # a line being written
        keys = [key for key in CURVE_KEYS if any(key in r for r in records)]
        return {"steps": [r.get("step") for r in records],
                "series": {key: [jsonable(r.get(key), False) for r in records] for key in keys}}


def _index(file: Path, step: int) -> list[_Line]:
    lines, offset = [], 0
    with open(file, "rb") as handle:
        for raw in handle:
            start, offset = offset, offset + len(raw)
            if not raw.endswith(b"\n"):
                break  # a file being written (dumps are atomic, so only a foreign one)
            record = json.loads(raw)
            summary = {"step": step, **{key: preview(record.get(key), tail=key == "prompt")
                                     for key in COLUMNS if key != "step"}}
            lines.append(_Line(file, start, step, str(record.get("data_source", "")), float(record.get("score", 0.0)),
                               summary))
    return lines
