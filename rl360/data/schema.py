"""The prompt schema (verl / Reasoning360 parquet files) and its checks.

`validate_file_schema` checks column types once, when a file is opened; `validate_row` checks the
values of one row. Every error is a `DataError` that names the file, and for a row its index within
the file and the key at fault.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from rl360.errors import UserError


class DataError(UserError):
    """Bad data; the message names the file (and the row and key where there is one)."""

    label = "data error"


def _is_string(kind: pa.DataType) -> bool:
    if pa.types.is_dictionary(kind):  # e.g. a pandas categorical column
        return _is_string(kind.value_type)
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _is_list(kind: pa.DataType) -> bool:
    return (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
            or pa.types.is_list_view(kind) or pa.types.is_large_list_view(kind))


def _is_message_list(kind: pa.DataType) -> bool:
    """list<struct<role: string, content: string, ...>> (extra message fields, e.g. tool calls, are fine)."""
    if not _is_list(kind) or not pa.types.is_struct(kind.value_type):
        return False
    message = kind.value_type
    return all(message.get_field_index(name) >= 0 and _is_string(message.field(name).type)
               for name in ("role", "content"))


def _is_ground_truth_struct(kind: pa.DataType) -> bool:
    return pa.types.is_struct(kind) and kind.get_field_index("ground_truth") >= 0


def _is_optional_extra(kind: pa.DataType) -> bool:
    return pa.types.is_struct(kind) or pa.types.is_map(kind)


def _is_image_list(kind: pa.DataType) -> bool:
    """A list of {bytes, path} structs, or of raw bytes / paths; or one {bytes, path} struct (a row's only image, as
    PyVision-RL's rl_dataset.py reads it)."""
    if pa.types.is_struct(kind):
        return kind.get_field_index("bytes") >= 0 or kind.get_field_index("path") >= 0
    if not _is_list(kind):
        return False
    item = kind.value_type
    return (pa.types.is_struct(item) or _is_string(item) or pa.types.is_binary(item)
            or pa.types.is_large_binary(item) or pa.types.is_binary_view(item))


# column -> (type check, what is expected, required)
_COLUMNS = {
    "prompt": (_is_message_list, "a list of {role: string, content: string} messages", True),
    "data_source": (_is_string, "a string", True),
    "reward_model": (_is_ground_truth_struct, "a struct with a 'ground_truth' field", True),
    "ability": (_is_string, "a string", False),
    "extra_info": (_is_optional_extra, "a struct (or map)", False),
    "images": (_is_image_list, "a list of {bytes, path} images (or one {bytes, path} image)", False),
}


def validate_file_schema(path: str, schema: pa.Schema) -> None:
    """Check the columns of the parquet file at `path` (its arrow `schema`); raise DataError if one is wrong.

    Required: prompt, data_source, reward_model. Optional: ability, extra_info, images (an optional column
    whose values are all null, stored with the null type, is accepted). Other columns are allowed.
    """
    for column, (check, expected, required) in _COLUMNS.items():
        index = schema.get_field_index(column)
        if index < 0:
            if required:
                raise DataError(f"{path}: missing column {column!r} (expected {expected}); "
                                f"the file has columns {schema.names}")
            continue
        kind = schema.field(index).type
        if not required and pa.types.is_null(kind):
            continue
        if not check(kind):
            raise DataError(f"{path}: column {column!r} has type {kind}, expected {expected}")


def validate_row(row: dict[str, Any], path: str, row_index: int) -> None:
    """Check one row (Python values) read from `path`; `row_index` is its index within that file."""
    where = f"{path} row {row_index}"
    prompt = row.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"{where}: key 'prompt' must be a non-empty list of {{role, content}} messages, "
                        f"got {_short(prompt)}")
    for number, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise DataError(f"{where}: key 'prompt'[{number}] must be a {{role, content}} message, "
                            f"got {_short(message)}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise DataError(f"{where}: key 'prompt'[{number}].{key} must be a string, "
                                f"got {_short(message.get(key))}")
    source = row.get("data_source")
    if not isinstance(source, str) or not source:
        raise DataError(f"{where}: key 'data_source' must be a non-empty string, got {_short(source)}")
    reward = row.get("reward_model")
    if not isinstance(reward, dict) or reward.get("ground_truth") is None:
        raise DataError(f"{where}: key 'reward_model.ground_truth' is missing (reward_model is {_short(reward)})")
    validate_images(row.get("images"), where)


def validate_images(images: Any, where: str) -> None:
    """Check the types of a row's `images` (None, a list, or one {bytes, path} dict: a row's only image, as
    PyVision-RL's rl_dataset.py reads it): each item raw bytes, a path, or a {bytes, path} dict with bytes or a
    path. Only types: the bytes are read as an image where its header or pixels are needed."""
    if images is None:
        return
    if isinstance(images, dict):
        images = [images]
    if not isinstance(images, list | tuple):
        raise DataError(f"{where}: key 'images' must be a list of images, got {_short(images)}")
    for index, item in enumerate(images):
        key = f"key 'images'[{index}]"
        if isinstance(item, bytes | bytearray | memoryview):
            if len(item) == 0:
                raise DataError(f"{where}: {key} is empty (0 bytes)")
        elif isinstance(item, str):
            if not item:
                raise DataError(f"{where}: {key} is an empty path")
        elif isinstance(item, dict):
            data, path = item.get("bytes"), item.get("path")
            if data is not None and not (isinstance(data, bytes | bytearray | memoryview) and len(data) > 0):
                raise DataError(f"{where}: {key}.bytes must be non-empty bytes, got {_short(data)}")
            if data is None and not (isinstance(path, str) and path):
                raise DataError(f"{where}: {key} has neither bytes nor a path ({_short(item)})")
        else:
            raise DataError(f"{where}: {key} must be bytes, a path or a {{bytes, path}} dict, got {_short(item)}")


def extra_info_dict(value: Any) -> Any:
    """A row's `extra_info` as a dict when the column is a parquet map (read as a list of (key, value)
    pairs); any other value as it is."""
    if isinstance(value, list) and all(isinstance(pair, tuple | list) and len(pair) == 2 for pair in value):
        return dict(value)
    return value


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
