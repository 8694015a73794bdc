"""The DeepEyes and PyVision recipes: their preprocessing on fixtures in the sources' own layouts, the rows'
routes to the agents' rewards, the configs loaded with their agents, and `rl360 plan` counting their contexts."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rl360.agents.build import agent_from_config
from rl360.agents.parsers import parse_pyvision
from rl360.config import context_length, load_config
from rl360.data import validate_file_schema
from rl360.plan import plan
from rl360.rewards.check import check_reward_data
from rl360.rewards.registry import JudgeNotConfigured

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "preprocess"
MODEL_CONFIG = ROOT / "tests" / "fixtures" / "configs" / "qwen2.5-vl-7b.json"


def _run(module: str, fixture: str, out: Path, *extra: str) -> list[dict]:
    main = __import__(f"data_preprocess.agents.{module}", fromlist=["main"]).main
    path = main(["--input", str(FIXTURES / fixture), "--out", str(out), *extra])
    assert path == out / "train" / f"agent__{module}.parquet"
    validate_file_schema(str(path), pq.ParquetFile(path).schema_arrow)
    return pq.read_table(path).to_pylist()


def _tools_in(system: str) -> list[str]:
    block = system.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    return [json.loads(line)["function"]["name"] for line in block.splitlines()]


def test_deepeyes_rows_keep_the_sources_data_source_and_name_rl360s_tool(tmp_path):
    rows = _run("deepeyes", "deepeyes.parquet", tmp_path)
    assert [row["data_source"] for row in rows] == ["vstar", "chart", "thinklite_eureka"]
    assert [row["reward_model"]["ground_truth"] for row in rows] == ["A", "2019", "1"]
    source = pq.read_table(FIXTURES / "deepeyes.parquet").to_pylist()
    assert [[image["bytes"] for image in row["images"]] for row in rows] == \
        [[image["bytes"] for image in row["images"]] for row in source]
    for row in rows:
        system, user = row["prompt"]
        assert system["role"] == "system" and _tools_in(system["content"]) == ["image_zoom_in_tool"]
        assert user["content"].count("<image>") == 1
    assert "call **image_zoom_in_tool** if needed" in rows[0]["prompt"][1]["content"]  # DeepEyes' text unchanged
    assert rows[1]["extra_info"]["question"] == "In which year were sales highest?"
    assert rows[2]["extra_info"]["question"] == "How many triangles are in the figure?"
    assert "reward_metric" not in rows[0]["extra_info"]
    kept = _run("deepeyes", "deepeyes.parquet", tmp_path / "skip", "--skip-sources", "chart")
    assert [row["data_source"] for row in kept] == ["vstar", "thinklite_eureka"]


def test_pyvision_rows_from_both_of_its_layouts(tmp_path):
    rows = _run("pyvision", "pyvision.json", tmp_path)
    assert [row["data_source"] for row in rows] == ["deepeyes", "vstar"]
    assert [row["reward_model"]["ground_truth"] for row in rows] == ["red", "42"]
    assert [row["images"][0]["bytes"] for row in rows] == [
        (FIXTURES / "pyvision_images" / name).read_bytes() for name in ("sign.png", "plate.png")]
    system, user = rows[0]["prompt"]
    assert "<code>\n```python\n" in system["content"] and "<tool_call>" not in system["content"]
    example = system["content"].split("form and stop:\n", 1)[1].split("\nThe code runs", 1)[0]
    assert [call.arguments for call in parse_pyvision(example).calls] == [{"code": "# your code"}]
    assert user["content"].startswith("<image>") and user["content"].count("<image>") == 1
    assert "image_clue_0: width 96, height 64" in user["content"]
    assert "Question: What colour is the small square in the bottom right?" in user["content"]
    assert {row["extra_info"]["reward_metric"] for row in rows} == {"pyvision"}
    verl = _run("pyvision", "pyvision_verl.jsonl", tmp_path / "verl")
    assert verl[0]["data_source"] == "minio3" and verl[0]["extra_info"]["question"] == "How many squares are red?"
    assert verl[0]["images"][0]["bytes"] == (FIXTURES / "pyvision_images" / "sign.png").read_bytes()
    assert "Question: How many squares are red?" in verl[0]["prompt"][1]["content"]


@pytest.fixture()
def recipe_env(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(MODEL_CONFIG.read_text())
    data = tmp_path / "data"
    monkeypatch.setenv("RL360_MODEL_PATH", str(model))
    monkeypatch.setenv("RL360_DATA_DIR", str(data))
    return data


@pytest.mark.parametrize("recipe, module, fixture, tool, scorer, context", [
    ("deepeyes", "deepeyes", "deepeyes.parquet", "image_zoom_in_tool", "deepeyes_score", 8192 + 16384),
    ("pyvision", "pyvision", "pyvision.json", "python", "pyvision_score", 32000 + 20480),
])
def test_recipe_loads_routes_its_rows_and_plans_its_contexts(recipe_env, recipe, module, fixture, tool, scorer,
                                                             context):
    _run(module, fixture, recipe_env)
    cfg = load_config(f"configs/recipes/{recipe}.yaml")
    agent = agent_from_config(cfg)
    assert agent is not None and list(agent.tools)[0] == tool and agent.settings.max_turns == 5
    routes = check_reward_data(cfg.data.train_files, judge_configured=True)
    assert {route.ref for route in routes.values()} == {f"rl360.rewards.agentic:{scorer}"}
    with pytest.raises(JudgeNotConfigured, match="reward.judge.url"):
        check_reward_data(cfg.data.train_files, judge_configured=False)
    assert context_length(cfg) == context
    result = plan(cfg, gpu_memory_gb=80)
    assert result.fits(), result.problem()
    shown = subprocess.run([sys.executable, "-m", "rl360.cli", "plan", f"configs/recipes/{recipe}.yaml"],
                           capture_output=True, text=True, cwd=ROOT, check=False)
    assert shown.returncode == 0, shown.stderr
    assert f"context per sample: {context:,} tokens" in shown.stdout and f"({tool})" in shown.stdout


def test_pyvision_recipe_filters_partially_and_deepeyes_weights_its_reward(recipe_env):
    pyvision = load_config("configs/recipes/pyvision.yaml")
    assert pyvision.algorithm.filter_groups and pyvision.algorithm.partial_filter
    assert pyvision.algorithm.partial_filter_keep == ["done", "max_turns"]
    agent = agent_from_config(pyvision)
    assert agent.parser is parse_pyvision and agent.settings.stop_after_call
    deepeyes = load_config("configs/recipes/deepeyes.yaml", ["reward.deepeyes.tool_weight=0.5"])
    assert (deepeyes.reward.deepeyes.accuracy_weight, deepeyes.reward.deepeyes.format_weight,
            deepeyes.reward.deepeyes.tool_weight) == (0.8, 0.2, 0.5)


def test_partial_filter_settings_are_checked(recipe_env):
    from rl360.config import ConfigError

    for overrides, message in [
        (["algorithm.filter_groups=false"], "set algorithm.filter_groups=true"),
        (["algorithm.partial_filter_keep=[done,finished]"], r"\['finished'\]"),
        (["algorithm.kl_in_reward_coef=0.01"], "kl_in_reward_coef=0"),
        (["algorithm.adv_estimator=gae"], "group estimator"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config("configs/recipes/pyvision.yaml", overrides)
