"""An `rl360 eval` output directory (rl360/eval: `results.jsonl`, `errors.jsonl`, `report.json`,
`eval_run.json`) as viewer rows, one per (prompt, sample) in order.

A sample's question, ground truth and data_source come from the evaluation's prompt files (named in
`eval_run.json`, read with the evaluation's own reader), else from `errors.jsonl`. Its outcome: `wrong` when
the rules scored it below 1 (it is in `errors.jsonl`), `rescued` when the LLM re-judge then said "Correct",
`right` otherwise once `report.json` is written, `unscored` before (an evaluation still running)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rl360.errors import UserError
from rl360.eval.config import EvalDataConfig
from rl360.eval.inputs import EvalPrompt, read_prompts
from rl360.eval.runner import RESULTS, RUN_FILE
from rl360.eval.scoring import ERRORS, REPORT
from rl360.rewards.judge import answer_for_judge
from rl360.view.values import jsonable, preview

OUTCOMES = ["right", "wrong", "rescued", "judged", "unscored", "error"]
COLUMNS = ["prompt", "sample", "data_source", "outcome", "score", "finish_reason", "tokens", "ground_truth",
           "answer", "question", "response"]


class EvalSource:
    kind = "eval"

    def __init__(self, out_dir: Path):
        self.path = out_dir
        results = _jsonl(out_dir / RESULTS)
        failures = {(r["prompt"], r["sample"]): r for r in _jsonl(out_dir / ERRORS)}
        self.report = json.loads((out_dir / REPORT).read_text()) if (out_dir / REPORT).is_file() else None
        self.prompt_note, prompts = _prompts(out_dir)
        keyed = {(r["prompt"], r["sample"]): r for r in results}
        self.records = [_sample(keyed[key], failures.get(key), prompts.get(key[0]), self.report is not None)
                        for key in sorted(keyed)]
        self.sources = sorted({r["data_source"] for r in self.records})

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": str(self.path), "total": len(self.records), "columns": COLUMNS,
                "summary": {"report": self.report, "prompts_note": self.prompt_note}, "curve": False}

    def filters(self, scan: bool = True) -> list[dict[str, Any]]:
        return [{"name": "data_source", "options": self.sources}, {"name": "outcome", "options": OUTCOMES}]

    def page(self, offset: int, limit: int, chosen: dict[str, str]) -> dict[str, Any]:
        source, outcome = chosen.get("data_source"), chosen.get("outcome")
        matched = [i for i, r in enumerate(self.records)
                   if (not source or r["data_source"] == source) and (not outcome or _has(r, outcome))]
        rows = [{"index": i, **{key: preview(self.records[i][key]) for key in COLUMNS}}
                for i in matched[offset:offset + limit]]
        return {"total": len(matched), "rows": rows}

    def row(self, index: int) -> dict[str, Any]:
        return {"index": index, "fields": jsonable(self.records[index], inline_images=True)}


def _has(record: dict, outcome: str) -> bool:
    if outcome == "judged":
        return record["judge"] is not None
    if outcome == "error":
        return bool(record["request_error"] or record["reward_error"])
    return record["outcome"] == outcome


def _sample(result: dict, failure: dict | None, prompt: EvalPrompt | None, scored: bool) -> dict[str, Any]:
    failure = failure or {}
    if failure:
        outcome = "rescued" if failure.get("correct_after_judge") else "wrong"
    else:
        outcome = "right" if scored and not result.get("error") else "unscored"
    return {"question": prompt.question() if prompt else failure.get("question"),
            "response": result.get("response", ""), "answer": answer_for_judge(result.get("response") or ""),
            "ground_truth": prompt.ground_truth if prompt else failure.get("ground_truth"),
            "outcome": outcome, "score": failure.get("score", 1.0 if outcome == "right" else None),
            "prompt": result["prompt"], "sample": result["sample"],
            "data_source": prompt.data_source if prompt else failure.get("data_source", ""),
            "finish_reason": result.get("finish_reason"), "tokens": result.get("tokens"),
            "messages": prompt.messages if prompt else None, "seed": result.get("seed"),
            "request_error": result.get("error"), "reward_error": failure.get("reward_error"),
            "reward_timed_out": failure.get("reward_timed_out"),
            "judge": failure.get("judge")}


def _prompts(out_dir: Path) -> tuple[str, dict[int, EvalPrompt]]:
    """The evaluation's prompts by index, read from the files its eval_run.json names (a note when they cannot
    be: the viewer then shows what errors.jsonl holds)."""
    run_file = out_dir / RUN_FILE
    if not run_file.is_file():
        return f"no {RUN_FILE}: questions shown for rule failures only", {}
    run = json.loads(run_file.read_text())
    try:
        prompts = read_prompts(EvalDataConfig(files=run["files"], prompt_field=run.get("prompt_field", ""),
                                              max_prompts=run.get("max_prompts", 0)))
    except (UserError, KeyError, OSError) as err:
        return f"prompt files not readable ({err}): questions shown for rule failures only", {}
    return "", {p.index: p for p in prompts}


def _jsonl(path: Path) -> list[dict]:
    """The whole lines of a JSON-lines file (a last line still being written is left out); [] when absent."""
    if not path.is_file():
        return []
    records = []
    with open(path, "rb") as handle:
        for raw in handle:
            if not raw.endswith(b"\n"):
                break
            try:
                records.append(json.loads(raw))
            except json.JSONDecodeError:
                break
    return records
