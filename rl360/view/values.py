"""Row values as the viewer's JSON: plain values as they are, bytes as an image (a `data:` URI) or a size, long
text cut for the list, and the small query-parameter checks every source shares."""

from __future__ import annotations

import base64
import datetime
import json
import math
from decimal import Decimal
from typing import Any

from rl360.service.app import ServiceError

PREVIEW_CHARS = 240
MAX_PAGE_ROWS = 500
_IMAGE_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"),
                (b"BM", "image/bmp"))


def image_type(data: bytes) -> str | None:
    """The MIME type of an image file's bytes (PNG, JPEG, GIF, WebP, BMP), None when they are not one."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return next((mime for magic, mime in _IMAGE_MAGIC if data.startswith(magic)), None)


def jsonable(value: Any, inline_images: bool) -> Any:
    """`value` (a row's cell, as pyarrow's `to_pylist` or `json.loads` gives it) in JSON's types. Bytes become
    `{"$image": "data:image/png;base64,..."}` with `inline_images` when they hold an image, else
    `{"$bytes": size, "$image_type": mime or null}`; NaN and infinities become null."""
    if isinstance(value, dict):
        return {str(key): jsonable(item, inline_images) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item, inline_images) for item in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        mime = image_type(data)
        if inline_images and mime:
            return {"$image": f"data:{mime};base64,{base64.b64encode(data).decode()}"}
        return {"$bytes": len(data), "$image_type": mime}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, (datetime.date, datetime.time, datetime.timedelta)):
        return str(value)
    return value


def preview(value: Any, chars: int = PREVIEW_CHARS, tail: bool = False) -> Any:
    """A short form of a cell for the list: chat messages as their last message's text, other structures as
    compact JSON, text cut to its first `chars` characters (its last with `tail`; an ellipsis marks the cut);
    numbers and null as they are."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and "content" in m for m in value):
        last = value[-1]
        value = f"[{len(value)} messages] {last.get('role', '')}: {last.get('content')}"
    if not isinstance(value, str):
        value = json.dumps(_bytes_named(value), ensure_ascii=False, separators=(",", ":"))
    if len(value) <= chars:
        return value
    return "…" + value[-chars:] if tail else value[:chars] + "…"


def _bytes_named(value: Any) -> Any:
    """`jsonable`'s byte placeholders as short names ("image/png 1234 bytes") for a preview."""
    if isinstance(value, dict):
        if "$bytes" in value:
            return f"{value.get('$image_type') or 'binary'} {value['$bytes']} bytes"
        return {key: _bytes_named(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_bytes_named(item) for item in value]
    return value


def int_param(query: dict[str, str], name: str, default: int, low: int, high: int) -> int:
    """Query parameter `name` as an integer in [low, high] (`default` when absent); 400 naming it otherwise."""
    text = query.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise ServiceError(400, f"'{name}' must be an integer, got {text[:40]!r}", name) from None
    if not low <= value <= high:
        raise ServiceError(400, f"'{name}' must be in [{low}, {high}], got {value}", name)
    return value


def choice_param(query: dict[str, str], name: str, options: list[str] | None) -> str:
    """Query parameter `name` ("" when absent), checked to be one of `options` when they are known."""
    value = query.get(name, "")
    if value and options is not None and value not in options:
        shown = ", ".join(options[:20]) + (" ..." if len(options) > 20 else "")
        raise ServiceError(400, f"'{name}' must be one of {shown}; got {value[:80]!r}", name)
    return value
