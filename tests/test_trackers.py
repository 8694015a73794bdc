"""swanlab (offline) and TensorBoard beside metrics.jsonl: the values each writes, read back with its own reader,
equal metrics.jsonl's; a resumed run does not show the re-run steps twice where the backend allows it."""

import io
import json

import pytest

from rl360.config import ConfigError, RunConfig, validate
from rl360.tracking import backends
from rl360.tracking.tracker import Tracker

STEPS = {1: {"reward/mean": 0.25, "actor/kl": 0.125, "note": "text"},
         2: {"reward/mean": 0.5, "actor/kl": 0.0625, "note": "text"},
         3: {"reward/mean": 0.75, "actor/kl": 0.03125, "note": "text"}}


def _jsonl(out) -> dict[tuple[str, int], float]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {(key, line["step"]): value for line in lines for key, value in line.items()
            if key != "step" and isinstance(value, float)}


def _tensorboard(out) -> dict[tuple[str, int], float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    return {(tag, event.step): event.value for tag in events.Tags()["scalars"] for event in events.Scalars(tag)}


def _started(path) -> int:
    """Orders swanlab's run directories as they were written: their names carry whole seconds and a random id,
    so two runs within one second would otherwise sort by chance."""
    return path.parent.stat().st_ctime_ns


def _swanlab(out) -> list[dict[tuple[str, int], float]]:
    """Each swanlab run file's scalars, read with swanlab's own record reader, in the order the runs started
    (swanlab's own system metrics, `__swanlab__.*`, left out)."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    runs = []
    for path in sorted((out / "swanlab").glob("run-*/run-*.swanlab"), key=_started):
        reader, values = DataStoreReader(), {}
        reader.open(path)
        for raw in reader:
            record = Record()
            record.ParseFromString(raw)
            if record.HasField("scalar") and not record.scalar.key.startswith("__swanlab__"):
                values[(record.scalar.key, record.scalar.step)] = record.scalar.value.number
        reader.close()
        runs.append(values)
    return runs


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """Three steps, then a resume from step 2's checkpoint that re-runs step 3 with another value."""
    out = tmp_path_factory.mktemp("trackers") / "run"
    first = Tracker(out, {"seed": 0}, console=io.StringIO(), use_swanlab=True, use_tensorboard=True)
    for step, metrics in STEPS.items():
        first.log(step, metrics)
    first.close()
    resumed = Tracker(out, {"seed": 0}, console=io.StringIO(), resume_after_step=2, use_swanlab=True,
                      use_tensorboard=True)
    resumed.log(3, {"reward/mean": 0.875, "actor/kl": 0.5})
    resumed.close()
    return out


def test_tensorboard_holds_metrics_jsonl_values_and_no_step_twice(resumed_run):
    expected = _jsonl(resumed_run)
    assert expected[("reward/mean", 3)] == 0.875 and len(expected) == 6
    assert _tensorboard(resumed_run) == expected  # step 3's first value purged on resume


def test_swanlab_offline_files_hold_metrics_jsonl_values(resumed_run):
    first, resumed = _swanlab(resumed_run)
    assert first == {(key, step): value for step, metrics in STEPS.items() for key, value in metrics.items()
                     if isinstance(value, float)}
    assert resumed == {("reward/mean", 3): 0.875, ("actor/kl", 3): 0.5}
    expected = _jsonl(resumed_run)
    assert {**first, **resumed} == expected


def test_a_missing_tracker_package_is_one_config_line(monkeypatch, tmp_path):
    real = backends.importlib.util.find_spec
    monkeypatch.setattr(backends.importlib.util, "find_spec", lambda name: None if name == "swanlab" else real(name))
    cfg = RunConfig()
    cfg.tracking.swanlab = True
    with pytest.raises(ConfigError, match=r"^tracking.swanlab=true needs the swanlab package: pip install swanlab$"):
        validate(cfg)
    with pytest.raises(backends.TrackerPackageMissing, match="pip install swanlab"):
        Tracker(tmp_path, {}, console=io.StringIO(), use_swanlab=True)
