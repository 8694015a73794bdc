"""Tool-call parsers: the text of one generated turn -> the tool calls it makes.

A parser is a function `parse(text) -> ParseResult`, registered by name (`register_parser`) or named by
reference as "package.module:function". A parser never raises on model output: a call it cannot read becomes
a `ToolCall` with `error` set, which the loop answers with that error as the tool's reply (and counts), so a
malformed call costs the model a turn, not the trajectory.

Built in: `hermes`, the format of Qwen2.5 / Qwen3 (and Hermes) chat templates:

    <tool_call>
    {"name": "image_zoom_in", "arguments": {"bbox_2d": [10, 20, 200, 240]}}
    </tool_call>

several per turn, each a JSON object with a string `name` and an object `arguments` (a JSON string holding an
object is accepted too, as some models write it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rl360.algos.registry import Registry


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's `name` and its `arguments`; `error` when the call could not be read (then `name`
    may be empty and `arguments` empty)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    raw: str = ""  # the call's text as the model wrote it


@dataclass(frozen=True)
class ParseResult:
    """The calls of one turn, in the order written (malformed ones included, with `error` set), and the turn's
    text outside them."""

    calls: tuple[ToolCall, ...] = ()
    content: str = ""

    @property
    def errors(self) -> int:
        return sum(1 for call in self.calls if call.error)


Parser = Callable[[str], ParseResult]
PARSERS: Registry[Parser] = Registry("tool-call parser")
register_parser = PARSERS.register
get_parser = PARSERS.get  # a registered name, or a "package.module:function" reference


_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)


@register_parser("hermes")
def parse_hermes(text: str) -> ParseResult:
    """Qwen/Hermes `<tool_call>{json}</tool_call>` blocks; an unclosed last block is read to the end of the
    text (a turn cut by the length limit), and reported as an error if its JSON is incomplete."""
    calls = []
    for match in _HERMES.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        calls.append(_hermes_call(body, closed, match.group(0)))
    content = _HERMES.sub("", text).strip()
    return ParseResult(tuple(calls), content)


parse_hermes.call_end = "</tool_call>"  # a turn may end here (`rl360.agents.loop.call_stop_ids`)


def _hermes_call(body: str, closed: bool, raw: str) -> ToolCall:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as error:
        where = "" if closed else " (the <tool_call> is not closed)"
        return ToolCall("", {}, f"the tool call is not valid JSON{where}: {error.msg} at char {error.pos}", raw)
    if not isinstance(data, dict):
        return ToolCall("", {}, f"a tool call must be a JSON object with 'name' and 'arguments', got "
                                f"{type(data).__name__}", raw)
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", {}, "the tool call has no 'name' string", raw)
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            return ToolCall(name, {}, f"the arguments of {name!r} are not valid JSON: {error.msg}", raw)
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, f"the arguments of {name!r} must be a JSON object, got "
                                  f"{type(arguments).__name__}", raw)
    return ToolCall(name, arguments, "", raw)
