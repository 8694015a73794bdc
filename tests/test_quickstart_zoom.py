"""`rl360 quickstart --task zoom` and `--task zoom-control`: a tiny Qwen2.5-VL reads a mark that only the
`image_zoom_in` tool's crop shows. With the tool it learns to call it and read the crop; without it the answer is
a guess (chance: 0.25). Both runs as the command runs them, each once for the module."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # whole training runs (`pytest -m "not slow"` leaves them out)

ROOT = Path(__file__).resolve().parents[1]


def _quickstart(tmp_path_factory, task: str) -> list[dict]:
    assets = tmp_path_factory.getbasetemp() / "zoom_assets"  # the model and data both tasks share
    out = tmp_path_factory.mktemp(task)
    result = subprocess.run(
        [sys.executable, "-m", "rl360.cli", "quickstart", "--task", task, f"model.path={assets / 'model'}",
         f"data.train_files=[{assets / 'data' / 'train.parquet'}]", f"output_dir={out}", "trainer.save_hf=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def zoom(tmp_path_factory):
    return _quickstart(tmp_path_factory, "zoom")


@pytest.fixture(scope="module")
def control(tmp_path_factory, zoom):  # after zoom: the shared assets are built once
    return _quickstart(tmp_path_factory, "zoom-control")


def _mean(records: list[dict], key: str) -> float:
    return sum(record[key] for record in records) / len(records)


def test_zoom_learns_to_call_the_tool_and_read_the_crop(zoom):
    assert len(zoom) == 60
    assert _mean(zoom[-5:], "agent/tool_calls/mean") > _mean(zoom[:5], "agent/tool_calls/mean") + 0.3
    assert _mean(zoom[-5:], "reward/mean") >= 0.65  # chance (0.25, the control's ceiling) + 0.4
    assert max(record["rollout/logprob_abs_diff"] for record in zoom) <= 1e-5  # tool images in the trainer too


def test_zoom_beats_its_control_by_the_tool(zoom, control):
    assert "agent/tool_calls/mean" not in control[-1]
    assert _mean(control[-5:], "reward/mean") <= 0.4
    assert _mean(zoom[-5:], "reward/mean") - _mean(control[-5:], "reward/mean") >= 0.4
