"""`rl360 quickstart --task tools` and `--task tools-control` end to end (the CLI, the tiny model, parquet built
by the task's script, the agent loop with the sandboxed python tool, GRPO): with the tool, the model learns to
call it and copy its answer; without, it stays at guessing."""

import json
from statistics import mean

import pytest
import ray

from rl360.cli import main

pytestmark = pytest.mark.slow  # whole training runs (`pytest -m "not slow"` leaves them out)


def _quickstart(root, task: str) -> list[dict]:
    """The task's whole run, as `rl360 quickstart --task TASK` runs it, its assets and output under `root`."""
    out = root / task
    try:
        assert main(["quickstart", "--task", task, f"output_dir={out}", f"model.path={root / 'model'}",
                     f"data.train_files=[{root / 'data' / 'train.parquet'}]", "trainer.save_hf=false"]) == 0
    finally:
        ray.shutdown()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("quickstart_tools")


@pytest.fixture(scope="module")
def tools(root):
    return _quickstart(root, "tools")


def test_with_the_tool_the_model_learns_to_call_it_and_answer(tools):
    first, last = tools[:5], tools[-5:]
    assert mean(r["reward/mean"] for r in last) >= 0.8, [r["reward/mean"] for r in last]
    calls = [r["agent/tool_calls/mean"] for r in tools]
    assert mean(calls[-5:]) > mean(calls[:5]), calls
    assert all(r["agent/tool_errors"] == 0 and r["agent/tool_timeouts"] == 0 for r in tools)
    assert all(r["rollout/logprob_abs_diff"] <= 1e-6 for r in first + last)  # tool tokens out, generated ones in step


def test_without_the_tool_the_model_only_guesses(root, tools):
    control = _quickstart(root, "tools-control")  # the same model and data (built by the tools run)
    assert "agent/tool_calls/mean" not in control[0]  # the agent loop is off
    assert mean(r["reward/mean"] for r in control[-5:]) <= 0.3
    assert mean(r["reward/accuracy_sampled"] for r in control[-5:]) <= 0.3
    assert mean(r["reward/accuracy_sampled"] for r in tools[-5:]) >= 0.8
