"""Agent rows as the references write them, read unchanged: a row as verl's DeepEyes recipe
(`recipe/deepeyes/deepeyes47k_preprocess.py`) writes it (data_source `hiyouga/DeepEyes-Datasets-47k`, `extra_info`
with `need_tools_kwargs` and `tools_kwargs.image_zoom_in_tool.create_kwargs.image` as a data URI, `images` as
datasets' Image structs), checked by the data schema, routed to DeepEyes' reward, its tool kwargs handed to the
trajectory, and DeepEyes' own call text answered by the `image_zoom_in_tool` tool.

And a row as PyVision-RL trains on it (`verl_agents/verl/utils/dataset/rl_dataset.py` reads it; the fields as its
`rl_dataset_wo_mm_hint.py` builds the same row): `images` one datasets Image struct per row, not a list, the
prompt's `<image>` the image, `env_name` naming its python tool, a `vl_agent` data_source (`deepeyes`, ...) routed to
PyVision's reward, and the image the python tool's `image_clue_0`."""

import asyncio
import base64
import io
import sys

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from rl360.agents.group import tool_kwargs
from rl360.agents.parsers import parse_hermes, parse_pyvision
from rl360.agents.tools import ToolSettings, TrajectoryState, build_tools, get_tool
from rl360.data import validate_file_schema, validate_row
from rl360.data.images import place_images, row_images
from rl360.rewards.registry import find_route

QUESTION = "<image>\nWhat is written on the small sign?"


def _image() -> bytes:
    image = Image.new("RGB", (640, 480), (0, 0, 0))
    image.paste((255, 0, 0), (300, 200, 310, 220))
    out = io.BytesIO()
    image.save(out, format="JPEG")
    return out.getvalue()


def _deepeyes_row(image: bytes, index: int) -> dict:
    """One row as verl's deepeyes47k_preprocess.py maps a DeepEyes-Datasets-47k row."""
    return {
        "data_source": "hiyouga/DeepEyes-Datasets-47k",
        "prompt": [{"role": "system", "content": "You are a helpful assistant."},
                   {"role": "user", "content": QUESTION}],
        "images": [{"bytes": image, "path": None}],
        "ability": "vqa",
        "reward_model": {"style": "model", "ground_truth": "STOP"},
        "extra_info": {
            "split": "train", "index": index, "answer": "STOP", "question": QUESTION, "need_tools_kwargs": True,
            "tools_kwargs": {"image_zoom_in_tool": {
                "create_kwargs": {"image": "data:image/jpeg;base64," + base64.b64encode(image).decode()}}},
        },
    }


def test_a_row_as_verls_deepeyes_recipe_writes_it_loads_routes_and_zooms_unchanged(tmp_path):
    image = _image()
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([_deepeyes_row(image, 0), _deepeyes_row(image, 1)]), path)
    validate_file_schema(str(path), pq.ParquetFile(path).schema_arrow)
    rows = pq.read_table(path).to_pylist()
    for number, row in enumerate(rows):
        validate_row(row, str(path), number)
    row = rows[0]
    assert find_route(row["data_source"], row["extra_info"].get("reward_metric")).ref.endswith(":deepeyes_score")
    kwargs = tool_kwargs(row)
    assert list(kwargs) == ["image_zoom_in_tool"] and kwargs["image_zoom_in_tool"]["image"].startswith("data:image")

    tools = build_tools(["image_zoom_in_tool"])
    text = ('<think>The sign is small.</think>\n<tool_call>\n{"name": "image_zoom_in_tool", "arguments": '
            '{"bbox_2d": [300, 200, 310, 220], "label": "the sign"}}\n</tool_call>')
    [call] = parse_hermes(text).calls
    assert call.name in tools and not call.error  # DeepEyes' name: no unknown-tool call
    state = TrajectoryState(images=[img["bytes"] for img in row["images"]], kwargs=kwargs)
    reply = asyncio.run(tools[call.name].call(call.arguments, state))
    assert not reply.failed and len(reply.images) == 1, reply
    assert reply.text == "Zoomed in on the image to the region [300, 200, 310, 220] with label the sign."
    crop = Image.open(io.BytesIO(reply.images[0])).convert("RGB")
    assert crop.height > crop.width  # the 10 x 20 box scaled to 28 x 56 (then resized by Qwen-VL's rule)
    assert crop.getpixel((crop.width // 2, crop.height // 2))[0] > 200  # the red sign at its centre


PYVISION_QUESTION = "<image>\nWhat colour is the small sign? Answer inside <answer></answer>."


def _pyvision_row(image: bytes, index: int, data_source: str) -> dict:
    """One row as PyVision-RL's `verl_agents/verl/utils/dataset/rl_dataset.py` reads it: `images` a single
    {bytes, path} struct (it hands `row[image_key]` itself to `process_image`), the `<image>` in the user message
    (which it renders `<image_clue_0><image></image_clue_0>`), `env_name` its python tool (`tool_name_key=env_name`
    in `verl_agents/examples/agent/*.sh`), and `reward_model` / `extra_info` as `rl_dataset_wo_mm_hint.py` writes
    them."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": PYVISION_QUESTION}],
        "images": {"bytes": image, "path": None},
        "ability": "vqa",
        "env_name": "visual_toolbox_v2",
        "reward_model": {"ground_truth": "red", "style": "model"},
        "extra_info": {"answer": "red", "index": index, "question": PYVISION_QUESTION, "split": "train"},
    }


def test_a_row_as_pyvision_rl_trains_on_it_loads_routes_and_is_image_clue_0(tmp_path, monkeypatch):
    image = _image()
    path = tmp_path / "train_1.parquet"
    sources = ["deepeyes", "zebra_cot", "vigorl", "wemath-2.0-standard"]  # names of its vl_agent reward
    table = pa.Table.from_pylist([_pyvision_row(image, i, source) for i, source in enumerate(sources)])
    image_struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # datasets' Image feature
    column = table.schema.get_field_index("images")
    pq.write_table(table.set_column(column, "images", table.column("images").cast(image_struct)), path)
    schema = pq.ParquetFile(path).schema_arrow
    assert pa.types.is_struct(schema.field("images").type)  # one image, not a list of them
    validate_file_schema(str(path), schema)
    rows = pq.read_table(path).to_pylist()
    for number, row in enumerate(rows):
        validate_row(row, str(path), number)
        assert find_route(row["data_source"], row["extra_info"].get("reward_metric")).ref.endswith(":pyvision_score")
    row = dict(rows[0], _source={"file": str(path), "row": 0})
    assert row_images(row) == (image,)
    [message] = place_images(row["prompt"], len(row_images(row)), "row 0")
    assert message["content"] == [{"type": "image"}, {"type": "text", "text": PYVISION_QUESTION[len("<image>"):]}]
    assert tool_kwargs(row) == {}

    # the sandbox's /usr/bin/python3 may lack PIL: run this interpreter, with the isolation it can have
    monkeypatch.setenv("RL360_SANDBOX_ISOLATION", "network,filesystem")
    monkeypatch.setenv("RL360_SANDBOX_REQUIRE_ISOLATION", "0")
    tool = get_tool("python", ToolSettings(timeout_s=30, python=sys.executable, workers=1))
    try:
        code = "print(image_clue_0.size, image_clue_0.getpixel((305, 210)))"
        text = f"Look at the sign.\n<code>\n```python\n{code}\n```\n</code>"  # PyVision's call text
        [call] = parse_pyvision(text).calls
        assert call.name == "python" and not call.error
        reply = asyncio.run(tool.call(call.arguments, TrajectoryState(images=list(row_images(row)))))
    finally:
        tool.close()
    assert not reply.failed and reply.text.startswith("(640, 480) ("), reply
    red = tuple(int(v) for v in reply.text.strip()[len("(640, 480) ("):-1].split(","))
    assert red[0] > 200 and red[1] < 60 and red[2] < 60, reply.text  # the prompt's image, its red sign (via JPEG)
