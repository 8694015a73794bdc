"""benchmarks/run_summary.py: a run's metrics.jsonl summarised as the device checks record it."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_run_is_summarised_from_its_metrics(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    steps = [{"step": i, "reward/mean": i / 10, "timing/step_s": 5.0 if i == 1 else 1.0 + i / 100,
              "rollout/logprob_abs_diff": 1e-7 * i, "rollout/logprob_abs_diff_max": 1e-6 * i,
              "timing/weight_sync_s": 0.5} for i in range(1, 8)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    out = tmp_path / "summary.json"
    result = subprocess.run([sys.executable, "benchmarks/run_summary.py", "default", str(run), "--json", str(out),
                             "--command", "rl360 quickstart"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    summary = json.loads(out.read_text())
    assert summary["steps"] == 7 and summary["command"] == "rl360 quickstart"
    assert summary["reward_first5"] == sum(i / 10 for i in range(1, 6)) / 5
    assert summary["reward_last5"] == sum(i / 10 for i in range(3, 8)) / 5
    assert summary["step_s_mean_after_first"] == sum(1.0 + i / 100 for i in range(2, 8)) / 6  # start-up left out
    assert summary["logprob_abs_diff_max"] == 7e-6
    assert "default on " in result.stdout and "7 steps" in result.stdout


def test_a_run_that_logged_nothing_is_a_failure(tmp_path):
    result = subprocess.run([sys.executable, "benchmarks/run_summary.py", "default", str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 1 and "did not log a step" in result.stderr
