"""`image_zoom_in`, DeepEyes' tool: crop a region of the image and show it to the model, larger.

Arguments: `{"bbox_2d": [x1, y1, x2, y2], "label": "..."}`, in pixels of the image (by default the prompt's
first image, as DeepEyes; `image_index` picks another of the trajectory's images, tool outputs included). As
DeepEyes does, the box is checked (four finite numbers, x1 < x2 and y1 < y2, an aspect ratio under 100),
clamped into the image (a box wholly outside it is refused), and a box under 28 px on a side (the smallest
image Qwen-VL's processor takes) is enlarged about its centre to 28 px, within the image. The crop is resized
by Qwen-VL's rule within [min_pixels, max_pixels] and costs its image tokens against the trajectory's
`max_image_tokens`; every failure is a message to the model, never an exception.
"""

from __future__ import annotations

import asyncio
import io
import math
from typing import Any

from rl360.agents.tools.base import ToolReply, ToolSettings, TrajectoryState, register_tool
from rl360.agents.tools.images import FACTOR, image_tokens, smart_resize

MIN_SIDE = FACTOR  # 28 px: a smaller box is enlarged to this
MAX_ASPECT = 100  # longer side / shorter side


def check_bbox(bbox: Any, width: int, height: int) -> tuple[int, int, int, int]:
    """The box to crop, in whole pixels inside a `width` x `height` image: clamped, and enlarged to
    MIN_SIDE about its centre where smaller. `ValueError` with the message for the model when it is unusable."""
    if not isinstance(bbox, (list, tuple)) or len(bbox) != 4:
        raise ValueError(f"bbox_2d must be a list of 4 numbers [x1, y1, x2, y2], got {bbox!r}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in bbox):
        raise ValueError(f"bbox_2d must hold 4 finite numbers, got {bbox!r}")
    x1, y1, x2, y2 = (float(v) for v in bbox)
    if not (x1 < x2 and y1 < y2):
        raise ValueError(f"bbox_2d {bbox!r} must have x1 < x2 and y1 < y2")
    if max(x2 - x1, y2 - y1) / min(x2 - x1, y2 - y1) > MAX_ASPECT:
        raise ValueError(f"bbox_2d {bbox!r} is too thin (aspect ratio over {MAX_ASPECT})")
    x1, x2 = max(0.0, x1), min(float(width), x2)
    y1, y2 = max(0.0, y1), min(float(height), y2)
    if not (x1 < x2 and y1 < y2):
        raise ValueError(f"bbox_2d {bbox!r} lies outside the image ({width} x {height})")
    x1, x2 = _at_least(x1, x2, min(MIN_SIDE, width), width)
    y1, y2 = _at_least(y1, y2, min(MIN_SIDE, height), height)
    return math.floor(x1), math.floor(y1), math.ceil(x2), math.ceil(y2)


def _at_least(low: float, high: float, side: float, limit: float) -> tuple[float, float]:
    """[low, high] widened about its centre to `side`, shifted back inside [0, limit]."""
    if high - low >= side:
        return low, high
    low = float(math.floor((low + high) / 2 - side / 2))  # whole pixels, exactly `side` wide
    high = low + side
    if low < 0:
        low, high = 0.0, side
    if high > limit:
        low, high = limit - side, limit
    return low, high


@register_tool("image_zoom_in")
class ImageZoomIn:
    name = "image_zoom_in"
    schema = {
        "type": "function",
        "function": {
            "name": "image_zoom_in",
            "description": "Zoom in on the image based on the bounding box coordinates.",
            "parameters": {
                "type": "object",
                "properties": {
                    "bbox_2d": {"type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 4,
                                "description": "The bounding box of the region to zoom in, as [x1, y1, x2, y2] "
                                               "in pixels of the image, (x1, y1) its top left corner."},
                    "label": {"type": "string", "description": "The name or label of the object in the box."},
                },
                "required": ["bbox_2d"],
            },
        },
    }

    def __init__(self, settings: ToolSettings):
        self.settings = settings

    async def call(self, arguments: dict[str, Any], state: TrajectoryState) -> ToolReply:
        return await asyncio.to_thread(self.zoom, arguments, state)

    def zoom(self, arguments: dict[str, Any], state: TrajectoryState) -> ToolReply:
        from PIL import Image

        index = arguments.get("image_index", 0)
        if not state.images:
            return ToolReply(error="there is no image to zoom in on")
        if not isinstance(index, int) or isinstance(index, bool) or not -len(state.images) <= index < len(state.images):
            return ToolReply(error=f"image_index {index!r} is not one of the {len(state.images)} images")
        try:
            image = Image.open(io.BytesIO(state.images[index]))
            image.load()
        except Exception as error:  # bad bytes in the data: the model is told, the loop goes on
            return ToolReply(error=f"the image cannot be read: {error}")
        try:
            box = check_bbox(arguments.get("bbox_2d"), image.width, image.height)
        except ValueError as error:
            return ToolReply(error=str(error))
        crop = image.crop(box)
        height, width = smart_resize(crop.height, crop.width, self.settings.min_pixels, self.settings.max_pixels)
        tokens = image_tokens(crop.height, crop.width, self.settings.min_pixels, self.settings.max_pixels)
        left = self.settings.max_image_tokens - state.image_tokens
        if tokens > left:
            return ToolReply(error=f"the image budget of this conversation is spent: the zoomed image would take "
                                   f"{tokens} image tokens, {max(left, 0)} are left; answer with what you have")
        state.image_tokens += tokens
        out = io.BytesIO()
        crop.convert("RGB").resize((width, height), Image.Resampling.BICUBIC).save(out, format="PNG")
        label = arguments.get("label")
        what = f" ({label})" if isinstance(label, str) and label else ""
        return ToolReply(f"Zoomed in on the region {list(box)}{what}.", (out.getvalue(),))
