"""Image helpers shared by the tools and the loop: sizes, Qwen-VL's resize rule and its token count."""

from __future__ import annotations

import io
import math

PATCH = 14  # Qwen2-VL / Qwen2.5-VL vision patch side
MERGE = 2  # patches merged per side into one image token
FACTOR = PATCH * MERGE  # 28: an image's sides are multiples of this
IMAGE_PAD = "<|image_pad|>"  # Qwen-VL's image token: one per merged patch of an image in the text


def smart_resize(height: int, width: int, min_pixels: int, max_pixels: int, factor: int = FACTOR) -> tuple[int, int]:
    """Qwen2-VL's resize rule: sides rounded to multiples of `factor`, the area brought within
    [min_pixels, max_pixels] keeping the aspect ratio. (height, width) after resizing."""
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def image_tokens(height: int, width: int, min_pixels: int, max_pixels: int) -> int:
    """The image-pad tokens a Qwen-VL model's processor expands an image of this size into."""
    h, w = smart_resize(height, width, min_pixels, max_pixels)
    return (h // FACTOR) * (w // FACTOR)


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) of PNG/JPEG bytes; `ValueError` when they are not an image."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except Exception as error:  # PIL raises several kinds for bad bytes
        raise ValueError(f"not a readable image: {error}") from None


def image_suffix(data: bytes) -> str:
    """The file suffix of image bytes by their magic number."""
    if data.startswith(b"\x89PNG"):
        return ".png"
    if data.startswith(b"\xff\xd8"):
        return ".jpg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return ".gif"
    if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        return ".webp"
    return ".img"


def qwen_vl_placeholder(data: bytes, min_pixels: int, max_pixels: int) -> str:
    """One image as Qwen2.5-VL's processor writes it into the text: vision start, the image pad once per
    merged patch, vision end."""
    width, height = image_size(data)
    count = image_tokens(height, width, min_pixels, max_pixels)
    return "<|vision_start|>" + IMAGE_PAD * count + "<|vision_end|>"
