"""`image_zoom_in_tool`, DeepEyes' tool (verl's name for it too): crop a region of the image and show it to the
model, larger. rl360's earlier name `image_zoom_in` is the same tool: configured by either name, it is shown to
the model under that name and answers calls made by the other.

Arguments: `{"bbox_2d": [x1, y1, x2, y2], "label": "..."}`, in pixels of the image (by default the prompt's
first image, as DeepEyes; `image_index` picks another of the trajectory's images, tool outputs included). The box
follows DeepEyes' and verl's rules, in their order: clamped into the image first, then checked (four finite
numbers, x1 < x2 and y1 < y2 once clamped, an aspect ratio of at most 100), and a box whose shorter side is under
28 px (the smallest image Qwen-VL's processor takes) is scaled up about its centre, keeping its aspect ratio,
until that side is 28 px (a 10 x 20 box becomes 28 x 56), scaled back down to fit the image if it outgrew it, and
shifted inside; a box still under 28 px a side (an image under 28 px) is refused. The crop is resized by
Qwen-VL's rule within [min_pixels, max_pixels] and costs its image tokens against the trajectory's
`max_image_tokens`; every failure is a message to the model, never an exception.
"""

from __future__ import annotations

import asyncio
import io
import math
from typing import Any

from rl360.agents.tools.base import ToolReply, ToolSettings, TrajectoryState, register_tool
from rl360.agents.tools.images import FACTOR, image_tokens, smart_resize

MIN_SIDE = FACTOR  # 28 px: a box with a shorter side is scaled up to this
MAX_ASPECT = 100  # longer side / shorter side


def check_bbox(bbox: Any, width: int, height: int) -> tuple[int, int, int, int]:
    """The box to crop, in whole pixels inside a `width` x `height` image (see the module docstring).
    `ValueError` with the message for the model when it is unusable."""
    if not isinstance(bbox, (list, tuple)) or len(bbox) != 4:
        raise ValueError(f"bbox_2d must be a list of 4 numbers [x1, y1, x2, y2], got {bbox!r}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in bbox):
        raise ValueError(f"bbox_2d must hold 4 finite numbers, got {bbox!r}")
    x1, y1 = max(0.0, float(bbox[0])), max(0.0, float(bbox[1]))
    x2, y2 = min(float(width), float(bbox[2])), min(float(height), float(bbox[3]))
    _check_shape(bbox, x1, y1, x2, y2, width, height)
    box_width, box_height = x2 - x1, y2 - y1
    if min(box_width, box_height) >= MIN_SIDE:
        return math.floor(x1), math.floor(y1), math.ceil(x2), math.ceil(y2)
    scale = MIN_SIDE / min(box_width, box_height)
    scale *= min(1.0, width / (box_width * scale), height / (box_height * scale))  # no larger than the image
    box_width, box_height = box_width * scale, box_height * scale
    left = min(max((x1 + x2) / 2 - box_width / 2, 0.0), width - box_width)
    top = min(max((y1 + y2) / 2 - box_height / 2, 0.0), height - box_height)
    box = (math.floor(left), math.floor(top), math.ceil(left + box_width), math.ceil(top + box_height))
    _check_shape(bbox, *box, width, height)
    if min(box[2] - box[0], box[3] - box[1]) < MIN_SIDE:
        raise ValueError(f"bbox_2d {list(bbox)!r} gives a crop under the minimum {MIN_SIDE} x {MIN_SIDE} px even "
                         f"enlarged (the image is {width} x {height})")
    return box


def _check_shape(bbox: Any, x1: float, y1: float, x2: float, y2: float, width: int, height: int) -> None:
    if not (x1 < x2 and y1 < y2):
        raise ValueError(f"bbox_2d {list(bbox)!r} must have x1 < x2 and y1 < y2 inside the image ({width} x "
                         f"{height})")
    if max(x2 - x1, y2 - y1) / min(x2 - x1, y2 - y1) > MAX_ASPECT:
        raise ValueError(f"bbox_2d {list(bbox)!r} is too thin (aspect ratio over {MAX_ASPECT})")


@register_tool("image_zoom_in_tool")
class ImageZoomIn:
    name = "image_zoom_in_tool"
    aliases = ("image_zoom_in",)  # calls by the other name reach it too

    @property
    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
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
        label = arguments.get("label")  # DeepEyes' and verl's reply: the box as asked for, and the label
        what = f" with label {label}" if isinstance(label, str) and label else ""
        return ToolReply(f"Zoomed in on the image to the region {arguments.get('bbox_2d')}{what}.", (out.getvalue(),))


@register_tool("image_zoom_in")
class ImageZoomInByItsEarlierName(ImageZoomIn):
    """The same tool shown to the model as `image_zoom_in` (configs and checkpoints trained under that name)."""

    name = "image_zoom_in"
    aliases = ("image_zoom_in_tool",)
