"""Prompt images: the verl schema's image items to compressed bytes, headers, decoding, and the processor of a
vision-language model (Qwen2-VL / Qwen2.5-VL) that expands each image into its tokens.

An image stays compressed (PNG/JPEG bytes) from the parquet file to the rank that needs its pixels: rendering a
prompt's token ids reads only each image's header (its size gives the processor's patch grid, and so the number
of image tokens); `VisionProcessor.pixel_inputs` decodes, for the model's forward.

Images with a side under 28 pixels (ThinkLite's, in DeepEyes) are scaled up, keeping their aspect ratio, until the
shorter side is 28: the Qwen-VL processors cannot take them otherwise. The token count and the pixels both see the
scaled size.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rl360.data.schema import DataError

MIN_SIDE = 28  # shorter sides below this are scaled up to it (the Qwen-VL processors' smallest patch grid)
IMAGE_PLACEHOLDER = "<image>"  # where verl / DeepVision / DeepEyes prompts put an image in the message text
VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")  # config.json model_type of the models this processor serves
_IMAGE_ERRORS = (OSError, ValueError, SyntaxError)  # what PIL raises for bytes it cannot read as an image


def image_bytes(item: Any, where: str, base_dir: str | os.PathLike | None = None) -> bytes:
    """The compressed bytes of one image item of the verl schema: raw bytes, a path (a relative one is taken
    from `base_dir`, the parquet file's directory), or a `{"bytes": ..., "path": ...}` dict (bytes when given,
    else the path). DataError names `where` (file, row and index) and what is wrong."""
    if isinstance(item, bytes | bytearray | memoryview):
        data = bytes(item)
        if not data:
            raise DataError(f"{where}: the image is empty (0 bytes)")
        return data
    if isinstance(item, str):
        return _read_path(item, where, base_dir)
    if isinstance(item, Mapping):
        if item.get("bytes") is not None:
            return image_bytes(item["bytes"], where, base_dir)
        if item.get("path") is not None:
            if not isinstance(item["path"], str):
                raise DataError(f"{where}: image 'path' must be a string, got {type(item['path']).__name__}")
            return _read_path(item["path"], where, base_dir)
        raise DataError(f"{where}: the image has neither 'bytes' nor 'path' (keys {sorted(item)})")
    raise DataError(f"{where}: an image must be bytes, a path or a {{bytes, path}} dict, got {type(item).__name__}")


def _read_path(path: str, where: str, base_dir: str | os.PathLike | None) -> bytes:
    if not path:
        raise DataError(f"{where}: the image path is empty")
    full = Path(path) if os.path.isabs(path) or base_dir is None else Path(base_dir) / path
    try:
        data = full.read_bytes()
    except OSError as err:
        raise DataError(f"{where}: cannot read image file {str(full)!r} ({type(err).__name__}: {err})") from None
    if not data:
        raise DataError(f"{where}: image file {str(full)!r} is empty")
    return data


def row_images(row: Mapping[str, Any]) -> tuple[bytes, ...]:
    """A prompt row's images as compressed bytes, in order (empty for a text row). Paths are taken from the
    directory of the row's file (`row["_source"]`, set by PromptStream); errors name the file, row and index.
    A lone {bytes, path} dict (an `images` column of single images, as PyVision-RL's rl_dataset.py reads it) is
    one image."""
    items = row.get("images")
    if isinstance(items, Mapping):
        items = [items]
    if items is None or len(items) == 0:
        return ()
    file = (row.get("_source") or {}).get("file")
    base_dir = os.path.dirname(os.path.abspath(file)) if file else None
    where = row_where(row)
    return tuple(image_bytes(item, f"{where}: key 'images'[{index}]", base_dir) for index, item in enumerate(items))


def row_where(row: Mapping[str, Any]) -> str:
    """Where a streamed row comes from, for errors: "FILE row N" (from `row["_source"]`), else "prompt row"."""
    source = row.get("_source") or {}
    return f"{source['file']} row {source.get('row')}" if source.get("file") else "prompt row"


def header_size(data: bytes, where: str) -> tuple[int, int]:
    """(width, height) of compressed image bytes, from the header only (no pixel is decoded)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
    except (*_IMAGE_ERRORS, Image.DecompressionBombError) as err:
        raise DataError(f"{where}: not a readable image ({len(data)} bytes; {type(err).__name__}: {err})") from None
    if width < 1 or height < 1:
        raise DataError(f"{where}: the image is {width}x{height} pixels")
    return width, height


def upscaled_size(width: int, height: int) -> tuple[int, int]:
    """The size an image is given before the processor: unchanged, or, when a side is under MIN_SIDE, scaled up
    keeping the aspect ratio until the shorter side is MIN_SIDE."""
    short = min(width, height)
    if short >= MIN_SIDE:
        return width, height
    scale = MIN_SIDE / short
    return max(MIN_SIDE, round(width * scale)), max(MIN_SIDE, round(height * scale))


def open_image(data: bytes, where: str = "image") -> Any:
    """The decoded image as an RGB `PIL.Image` (transparency over white), scaled up when a side is under
    MIN_SIDE pixels (`upscaled_size`)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            if image.mode != "RGB":
                background = Image.new("RGBA", image.size, (255, 255, 255, 255))
                background.alpha_composite(image.convert("RGBA"))
                image = background.convert("RGB")
            else:
                image = image.copy()
    except (*_IMAGE_ERRORS, Image.DecompressionBombError) as err:
        raise DataError(f"{where}: cannot decode the image ({len(data)} bytes; {type(err).__name__}: {err})") from None
    size = upscaled_size(*image.size)
    return image if size == image.size else image.resize(size, Image.Resampling.BICUBIC)


def is_vision_model(model_dir: str | os.PathLike) -> bool:
    """Whether the Hugging Face model directory holds a Qwen2-VL / Qwen2.5-VL model (its config.json
    model_type); False when there is no config.json (e.g. a tokenizer-only directory)."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return False
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(f"{config}: cannot be read as JSON ({err})") from None
    return model_type in VISION_MODEL_TYPES


def place_images(messages: Sequence[Mapping[str, Any]], count: int, where: str) -> list[dict[str, Any]]:
    """The messages with their images as content entries, for a vision chat template: each `<image>` in a
    message's text becomes `{"type": "image"}` in place, the text around it `{"type": "text", ...}` entries.

    The number of placeholders must equal `count`; a prompt without any gets its images before the text of its
    first user message (as verl does). Messages are returned unchanged when `count` is 0.
    """
    messages = [dict(message) for message in messages]
    if count == 0:
        return messages
    found = sum(str(message.get("content", "")).count(IMAGE_PLACEHOLDER) for message in messages)
    if found == 0:
        first_user = next((i for i, message in enumerate(messages) if message.get("role") == "user"), None)
        if first_user is None:
            raise DataError(f"{where}: the prompt has {count} image(s) but no {IMAGE_PLACEHOLDER} placeholder "
                            "and no user message to put them in")
        messages[first_user]["content"] = IMAGE_PLACEHOLDER * count + messages[first_user]["content"]
    elif found != count:
        raise DataError(f"{where}: the prompt has {found} {IMAGE_PLACEHOLDER} placeholder(s) but the row has "
                        f"{count} image(s); they must be equal (or the prompt must have none)")
    for message in messages:
        parts = str(message["content"]).split(IMAGE_PLACEHOLDER)
        content: list[dict[str, str]] = []
        for number, text in enumerate(parts):
            if number > 0:
                content.append({"type": "image"})
            if text:
                content.append({"type": "text", "text": text})
        message["content"] = content
    return messages


class VisionProcessor:
    """The image side of a Qwen2-VL / Qwen2.5-VL model: its chat template, tokenizer and image processor.

    `render` gives a prompt's token ids with every image expanded to its tokens (`<|vision_start|>`, the image
    pad token once per merged patch, `<|vision_end|>`), exactly as the model's `AutoProcessor` renders them, from
    the images' headers only; `pixel_inputs` decodes the images into what the model's forward takes.
    `min_pixels` / `max_pixels` bound each image's resized area (default: the image processor's own).

    Built from the processor's parts rather than from `AutoProcessor` itself: the latter also loads a video
    processor, which needs torchvision; `from_processor` wraps a loaded `AutoProcessor`.
    """

    def __init__(self, tokenizer: Any, image_processor: Any, chat_template: str | None = None,
                 min_pixels: int | None = None, max_pixels: int | None = None):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.chat_template:
            raise ValueError("the vision processor needs a chat template: the model directory has no "
                             "chat_template.jinja / chat_template.json and its tokenizer has none")
        default_min, default_max = _pixel_bounds(image_processor)
        self.min_pixels = int(min_pixels if min_pixels is not None else default_min)
        self.max_pixels = int(max_pixels if max_pixels is not None else default_max)
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"min_pixels={self.min_pixels}, max_pixels={self.max_pixels}; need "
                             "0 < min_pixels <= max_pixels")
        self.merge_size = int(image_processor.merge_size)
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no image token {self.image_token!r}")

    @classmethod
    def from_processor(cls, processor: Any, min_pixels: int | None = None,
                       max_pixels: int | None = None) -> VisionProcessor:
        """Wrap a loaded `AutoProcessor` (its tokenizer, image processor and chat template)."""
        return cls(processor.tokenizer, processor.image_processor, getattr(processor, "chat_template", None),
                   min_pixels, max_pixels)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike, tokenizer: Any = None, min_pixels: int | None = None,
                        max_pixels: int | None = None) -> VisionProcessor:
        """The processor of a Hugging Face model directory: its tokenizer (or `tokenizer`), its image processor
        (preprocessor_config.json) and the chat template the processor uses (chat_template.jinja, else
        chat_template.json, else the tokenizer's)."""
        from transformers import AutoImageProcessor, AutoTokenizer

        tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model_dir)
        image_processor = AutoImageProcessor.from_pretrained(model_dir)
        return cls(tokenizer, image_processor, processor_chat_template(model_dir), min_pixels, max_pixels)

    # ----- token ids ------------------------------------------------------------------------------------

    def image_grid(self, data: bytes, where: str = "image") -> tuple[int, int, int]:
        """The (t, h, w) patch grid the image processor gives this image (its `image_grid_thw` row), from its
        (scaled-up) header size alone: what M-RoPE positions need on ranks that never decode the pixels."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        stored = header_size(data, where)
        width, height = upscaled_size(*stored)
        patch = int(self.image_processor.patch_size)
        try:
            height, width = smart_resize(height, width, patch * self.merge_size, self.min_pixels, self.max_pixels)
        except ValueError as err:  # e.g. an aspect ratio over 200
            scaled = "" if stored == (width, height) else f" (scaled up to {width}x{height})"
            raise DataError(f"{where}: the image processor refuses a {stored[0]}x{stored[1]} image{scaled} "
                            f"({err})") from None
        return 1, height // patch, width // patch

    def image_tokens(self, data: bytes, where: str = "image") -> int:
        """How many image tokens one image expands to: its patches, divided by the merge_size x merge_size
        patches each token stands for."""
        t, h, w = self.image_grid(data, where)
        return t * h * w // self.merge_size ** 2

    def render(self, messages: Sequence[Mapping[str, Any]], images: Sequence[bytes] = (),
               where: str = "prompt") -> list[int]:
        """Token ids of `messages` under the chat template with the generation prompt, each image expanded to
        its tokens; `<image>` placeholders mark where the images go (see `place_images`)."""
        counts = [self.image_tokens(data, f"{where}: image {index}") for index, data in enumerate(images)]
        placed = place_images(messages, len(images), where)
        text = self.tokenizer.apply_chat_template(placed, chat_template=self.chat_template,
                                                  add_generation_prompt=True, tokenize=False)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        slots = [index for index, token in enumerate(ids) if token == self.image_token_id]
        if len(slots) != len(images):
            raise DataError(f"{where}: the chat template rendered {len(slots)} image token(s) for "
                            f"{len(images)} image(s) (does the text itself hold {self.image_token!r}?)")
        expanded: list[int] = []
        start = 0
        for slot, count in zip(slots, counts):
            expanded += ids[start:slot] + [self.image_token_id] * count
            start = slot + 1
        return expanded + ids[start:]

    # ----- pixels -----------------------------------------------------------------------------------------

    def pixel_inputs(self, images: Sequence[bytes], where: str = "images") -> dict[str, Any]:
        """What the model's forward takes for these images (decoded here): `pixel_values`, one row per patch of
        every image in order, and `image_grid_thw`, one (t, h, w) row per image."""
        if not images:
            raise ValueError("pixel_inputs needs at least one image")
        decoded = [open_image(data, f"{where}[{index}]") for index, data in enumerate(images)]
        out = self.image_processor(images=decoded, return_tensors="pt",
                                   size={"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels})
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def _pixel_bounds(image_processor: Any) -> tuple[int, int]:
    """The image processor's (min_pixels, max_pixels): `size` {shortest_edge, longest_edge} (transformers 5),
    else its min_pixels / max_pixels attributes."""
    size = getattr(image_processor, "size", None) or {}
    low = size.get("shortest_edge") if hasattr(size, "get") else getattr(size, "shortest_edge", None)
    high = size.get("longest_edge") if hasattr(size, "get") else getattr(size, "longest_edge", None)
    low = low if low is not None else getattr(image_processor, "min_pixels", None)
    high = high if high is not None else getattr(image_processor, "max_pixels", None)
    if low is None or high is None:
        raise ValueError(f"{type(image_processor).__name__} states no min/max pixels (size={size!r})")
    return int(low), int(high)


def processor_chat_template(model_dir: str | os.PathLike) -> str | None:
    """The chat template a model directory's processor uses: chat_template.jinja, else the "chat_template" of
    chat_template.json; None when it has neither (the tokenizer's applies)."""
    model_dir = Path(model_dir)
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    stored = model_dir / "chat_template.json"
    if stored.is_file():
        try:
            return json.loads(stored.read_text(encoding="utf-8"))["chat_template"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise DataError(f"{stored}: expected a JSON object with a 'chat_template' string ({err})") from None
    return None
