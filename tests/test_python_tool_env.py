"""The python tool's image interpreter: a virtual environment of the interpreter the sandbox runs, with PIL and
numpy copied from this environment, so PyVision-style code sees `image_clue_0`, ... and shows images back under
the sandbox's full isolation (its own uid), not only where the isolation is relaxed to run this interpreter."""

import asyncio
import io
from pathlib import Path

import pytest
from PIL import Image

from rl360.agents.tools import ToolSettings, TrajectoryState, get_tool
from rl360.agents.tools.python_env import make_tool_python, missing_modules, requirement_closure
from rl360.rewards.sandbox import isolation

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tool_python():
    if "uid" not in isolation().in_effect:
        pytest.skip("the sandbox cannot switch to a uid of its own here")
    return str(make_tool_python(ROOT / "build" / "test-tool-python", ("pillow", "numpy")))


def _png(width, height):
    image = Image.new("RGB", (width, height), (255, 255, 255))
    image.paste((200, 30, 30), (60, 40, 80, 60))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def test_the_environment_imports_the_image_libraries_in_the_sandbox(tool_python):
    assert missing_modules(tool_python, ("PIL", "numpy")) == []
    assert missing_modules(tool_python, ("PIL", "no_such_module_rl360")) == ["no_such_module_rl360"]
    assert {dist.metadata["Name"].lower() for dist in requirement_closure(["pillow", "numpy"])} == {"pillow", "numpy"}


def test_pyvision_code_sees_the_images_and_shows_a_crop_back(tool_python):
    tool = get_tool("python", ToolSettings(timeout_s=60, python=tool_python, max_image_tokens=10_000))
    state = TrajectoryState(images=[_png(100, 80)])
    code = ("import numpy as np, os\n"
            "pixels = np.asarray(image_clue_0)\n"
            "ys, xs = np.nonzero(pixels[:, :, 1] < 100)\n"
            "print(image_clue_0.size, xs.min(), xs.max(), ys.min(), ys.max(), os.getuid() != 0)\n"
            "image_clue_0.crop((xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)).resize((56, 56)).show()")
    reply = asyncio.run(tool.call({"code": code}, state))
    assert not reply.failed, reply
    assert reply.text == "(100, 80) 60 79 40 59 True\n"  # found the red square, as a uid other than root's
    shown, = (Image.open(io.BytesIO(data)) for data in reply.images)
    assert shown.size == (56, 56) and shown.getpixel((28, 28)) == (200, 30, 30)
    again = asyncio.run(tool.call({"code": "print(int(pixels.mean()))"}, state))  # the state carries on
    assert again.text.strip().isdigit() and not again.failed


def test_an_unreachable_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="of its own"):
        make_tool_python(tmp_path / "env", ("pillow",))
