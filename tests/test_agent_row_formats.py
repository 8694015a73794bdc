"""Agent rows as the references write them, read unchanged: a row as verl's DeepEyes recipe
(`recipe/deepeyes/deepeyes47k_preprocess.py`) writes it (data_source `hiyouga/DeepEyes-Datasets-47k`, `extra_info`
with `need_tools_kwargs` and `tools_kwargs.image_zoom_in_tool.create_kwargs.image` as a data URI, `images` as
datasets' Image structs), checked by the data schema, routed to DeepEyes' reward, its tool kwargs handed to the
trajectory, and DeepEyes' own call text answered by the `image_zoom_in_tool` tool."""

import asyncio
import base64
import io

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from rl360.agents.group import tool_kwargs
from rl360.agents.parsers import parse_hermes
from rl360.agents.tools import TrajectoryState, build_tools
from rl360.data import validate_file_schema, validate_row
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
