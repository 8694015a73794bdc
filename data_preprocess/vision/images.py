"""What the vision scripts share: a record's images as compressed bytes, and the prompt text's <image>
placeholders matched to them.

Images come as the source stores them: raw bytes, `{bytes, path}` items (Hugging Face's Image feature in parquet),
paths (taken from the input's directory: the --input file's, or the --input directory itself), or decoded
`PIL.Image`s (a Hugging Face dataset loaded by name). Every image is written as compressed bytes, so the output
file needs nothing beside it; each must have a readable image header.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import Any

from data_preprocess.common import RecordError
from rl360.data.images import IMAGE_PLACEHOLDER, header_size, image_bytes


def input_dir(args: argparse.Namespace) -> Path:
    """The directory that relative image paths of the input are taken from."""
    source = Path(args.input)
    return source if source.is_dir() else source.parent


def record_images(value: Any, field: str, base_dir: Path) -> list[bytes]:
    """The images of a record's `field` (a list of images, or one image) as compressed bytes."""
    items = value if isinstance(value, list | tuple) else [value]
    if not items:
        raise RecordError(f"field {field!r} holds no image")
    return [_compressed(item, f"field {field!r}[{number}]", base_dir) for number, item in enumerate(items)]


def _compressed(item: Any, where: str, base_dir: Path) -> bytes:
    if hasattr(item, "save") and hasattr(item, "size"):  # a decoded PIL image
        out = io.BytesIO()
        item.save(out, format=item.format or "PNG")
        data = out.getvalue()
    else:
        data = image_bytes(item, where, base_dir)
    header_size(data, where)
    return data


def with_placeholders(text: str, count: int) -> str:
    """`text` with one <image> placeholder per image: as it is when it holds `count` of them, with them put in
    front when it holds none; RecordError otherwise."""
    found = text.count(IMAGE_PLACEHOLDER)
    if found == count:
        return text
    if found == 0:
        return IMAGE_PLACEHOLDER * count + text
    raise RecordError(f"the text holds {found} {IMAGE_PLACEHOLDER} placeholder(s) for {count} image(s)")


def strip_placeholders(text: str) -> str:
    """The text without its <image> placeholders (the question as a judge reads it)."""
    return text.replace(IMAGE_PLACEHOLDER, "").strip()
