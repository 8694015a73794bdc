"""Tracker: metrics.jsonl cut back on resume and one wandb run across a resume (wandb offline)."""

import io
import json
import re

from rl360.tracking.tracker import Tracker


def _run_ids(out):
    """The run id of each offline run directory: `offline-run-<date>_<time>-<id>`, with `-<n>` added by wandb when
    a directory of that name exists (a resume within the same second)."""
    return sorted(re.fullmatch(r"offline-run-\d{8}_\d{6}-([a-z0-9]+)(?:-\d+)?", path.name).group(1)
                  for path in (out / "wandb").glob("offline-run-*"))


def test_resume_continues_the_wandb_run_and_a_fresh_run_starts_a_new_one(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    first = Tracker(out, {"seed": 0}, use_wandb=True, console=io.StringIO())
    for step in (1, 2, 3):
        first.log(step, {"reward/mean": step / 10})
    first.close()
    resumed = Tracker(out, {"seed": 0}, use_wandb=True, console=io.StringIO(), resume_after_step=2)
    resumed.log(3, {"reward/mean": 0.35})
    resumed.close()
    ids = _run_ids(out)
    assert len(ids) == 2 and ids[0] == ids[1] == (out / "wandb_run_id").read_text().strip()
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["reward/mean"]) for line in lines] == [(1, 0.1), (2, 0.2), (3, 0.35)]

    fresh = Tracker(out, {"seed": 0}, use_wandb=True, console=io.StringIO())  # same directory, no resume
    fresh.close()
    assert len(set(_run_ids(out))) == 2
