"""The zoom quickstart's task holds its premise: the model's processor sees the same grey image whatever the mark's
colour, the `image_zoom_in_tool` crop of the mark's box shows the colour, and the whole call and the tool's reply
text are one token each of the task's tokenizer. Its rows are DeepEyes-format rows (`extra_info.tools_kwargs` for
`image_zoom_in_tool`, as verl's DeepEyes recipe writes them) and train through `agent.loop=tools` calling the tool by
DeepEyes' name, with no unknown-tool call."""

import base64
import io
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image
from transformers import AutoTokenizer

from rl360.agents import AgentSettings
from rl360.agents.build import agent_from_config
from rl360.agents.group import tool_kwargs
from rl360.agents.parsers import parse_hermes
from rl360.agents.tools import TrajectoryState
from rl360.config import load_config
from rl360.data import validate_file_schema, validate_row
from rl360.data.images import VisionProcessor
from rl360.quickstart.prepare import _script, prepare_quickstart


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoom_task")
    cfg = load_config("configs/quickstart_zoom.yaml", [f"model.path={root / 'model'}",
                                                      f"data.train_files=[{root / 'data' / 'train.parquet'}]"])
    prepare_quickstart(cfg, "zoom")
    return cfg, _script("synthetic_zoom")


def test_the_call_and_the_reply_are_one_token_each(task):
    cfg, zoom = task
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    assert len(tokenizer.encode(zoom.CALL, add_special_tokens=False)) == 1
    assert len(tokenizer.encode(zoom.REPLY, add_special_tokens=False)) == 1
    assert tokenizer.unk_token_id not in tokenizer.encode(zoom.QUESTION + "tool", add_special_tokens=False)
    [call] = parse_hermes(zoom.CALL).calls
    assert call.name == "image_zoom_in_tool" and call.arguments == {"bbox_2d": zoom.BBOX} and not call.error
    agent = agent_from_config(cfg)  # the config's agent bounds fit the model's processor
    assert agent.settings == AgentSettings(max_turns=2, max_response_length=cfg.rollout.max_response_length,
                                           min_pixels=784, max_pixels=12544, stop_after_call=True, batch_turns=True,
                                           max_turn_tokens=6)


def test_only_the_crop_shows_the_colour(task):
    cfg, zoom = task
    processor = VisionProcessor.from_pretrained(cfg.model.path)
    rows = pq.read_table(cfg.data.train_files[0]).to_pylist()
    assert sorted({row["reward_model"]["ground_truth"] for row in rows}) == ["1", "2", "3", "4"]
    images = {answer: zoom.draw_image(answer) for answer in (1, 2, 3, 4)}
    seen = {answer: processor.pixel_inputs([data])["pixel_values"] for answer, data in images.items()}
    # what the model sees of the whole image: the same for every colour, up to the resize's rounding
    assert max((seen[answer] - seen[1]).abs().max().item() for answer in seen) < 0.05
    tool = agent_from_config(cfg).tools["image_zoom_in_tool"]
    crops = {}
    for answer, data in images.items():
        reply = tool.zoom({"bbox_2d": zoom.BBOX}, TrajectoryState(images=[data]))
        assert reply.text == zoom.REPLY and not reply.error
        assert Image.open(io.BytesIO(reply.images[0])).size == (zoom.MARK, zoom.MARK)
        crops[answer] = processor.pixel_inputs(list(reply.images))["pixel_values"]
    assert min((crops[a] - crops[b]).abs().max().item() for a in crops for b in crops if a < b) > 1.0


def test_the_model_calls_first_in_about_half_its_replies_whatever_the_colour(task):
    """The built model's prior to call the tool first, the same for every answer: it tells nothing about the colour."""
    from rl360.quickstart.vision_assets import first_token_probability

    cfg, zoom = task
    probabilities = [first_token_probability(cfg.model.path, zoom.CALL, zoom.QUESTION, zoom.draw_image(answer))
                     for answer in (1, 2, 3, 4)]
    assert all(abs(p - zoom.CALL_PRIOR) < 0.02 for p in probabilities), probabilities


def test_after_the_crop_the_model_names_its_colour_about_as_primed_and_seldom_calls_again(task):
    """The reading habit, through the contexts the real agent loop and zoom tool give after a call: the crop's
    colour named right about `READ_PRIOR` of the time, a second call rare."""
    import torch

    from rl360.data import PromptRenderer
    from rl360.engine.hf_engine import HFEngine
    from rl360.quickstart.priming import answer_contexts
    from rl360.quickstart.zoom_assets import READ_PRIOR

    cfg, zoom = task
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    rows = zoom.make_rows(8, "check", seed=5)
    agent = agent_from_config(cfg)
    renderer = PromptRenderer.for_model(cfg.model.path, tokenizer, 1 << 20)
    contexts = answer_contexts([renderer.prompt(row) for row in rows], tokenizer.convert_tokens_to_ids(zoom.CALL),
                               tokenizer.eos_token_id, tokenizer, agent.tools, agent.parser, agent.settings)
    engine = HFEngine(cfg.model.path)
    with torch.no_grad():
        batch = engine.prefill(contexts)
        probs = engine.model(attention_mask=batch.mask, position_ids=batch.positions,
                             **batch.first_inputs()).logits[:, -1].softmax(-1)
    answers = tokenizer.convert_tokens_to_ids([f"\\boxed{{{row['reward_model']['ground_truth']}}}" for row in rows])
    right = probs[torch.arange(len(rows)), answers]
    assert abs(float(right.mean()) - READ_PRIOR) < 0.15, right
    assert float(probs[:, tokenizer.convert_tokens_to_ids(zoom.CALL)].mean()) < 0.1


def test_the_rows_are_laid_out_as_deepeyes_rows(task):
    """`extra_info.need_tools_kwargs` and `tools_kwargs.image_zoom_in_tool.create_kwargs.image` (the row's image as
    a data URI), as verl's DeepEyes recipe writes them; checked by the data schema; the kwargs reach the tool."""
    cfg, _ = task
    path = cfg.data.train_files[0]
    validate_file_schema(path, pq.ParquetFile(path).schema_arrow)
    rows = pq.read_table(path).to_pylist()
    for number, row in enumerate(rows[:16]):
        validate_row(row, path, number)
        assert row["extra_info"]["need_tools_kwargs"] is True
        [(name, kwargs)] = tool_kwargs(row).items()
        assert name == "image_zoom_in_tool"
        assert base64.b64decode(kwargs["image"].removeprefix("data:image/png;base64,")) == row["images"][0]["bytes"]


@pytest.fixture(scope="module")
def trained(task, tmp_path_factory) -> list[dict]:
    """Two steps of the zoom quickstart's own config on its DeepEyes-format rows (a smaller batch)."""
    cfg, _ = task
    out = tmp_path_factory.mktemp("zoom_run") / "run"
    done = subprocess.run([sys.executable, "-m", "rl360.cli", "train", "configs/quickstart_zoom.yaml",
                           f"output_dir={out}", f"model.path={cfg.model.path}",
                           f"data.train_files=[{cfg.data.train_files[0]}]", "data.batch_size=4", "rollout.n=4",
                           "actor.ppo_mini_batch_size=4", "trainer.total_steps=2", "trainer.save_every=0"],
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_deepeyes_rows_train_through_the_agent_loop_calling_image_zoom_in_tool(trained):
    """Every call made names `image_zoom_in_tool` (no other tool name, so no unknown-tool call) and none fails."""
    assert [m["step"] for m in trained] == [1, 2]
    for metrics in trained:
        called = {key.removeprefix("agent/calls/") for key in metrics if key.startswith("agent/calls/")}
        assert called == {"image_zoom_in_tool"}, metrics
        assert metrics["agent/calls/image_zoom_in_tool"] > 0 and metrics["agent/tool_errors"] == 0
        assert metrics["agent/errors/image_zoom_in_tool"] == 0


@pytest.mark.slow
def test_the_engines_busy_share_of_an_agent_step_is_logged(trained):
    """`timing/engine_busy_frac`: the share of the rollout's time the engine had requests in flight while the
    trajectories' turns and tool calls alternated."""
    for metrics in trained:
        assert 0 < metrics["timing/engine_busy_frac"] <= 1.0 + 1e-6, metrics
