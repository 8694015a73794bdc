"""Tool-call parsers: the text of one generated turn -> the tool calls it makes.

A parser is a function `parse(text) -> ParseResult`, registered by name (`register_parser`) or named by
reference as "package.module:function". A parser never raises on model output: a call it cannot read becomes
a `ToolCall` with `error` set, which the loop answers with that error as the tool's reply (and counts), so a
malformed call costs the model a turn, not the trajectory.

A parser may name the text that closes a call (`parser.call_end`), for `agent.stop_after_call`.

Built in: `hermes`, the format of Qwen2.5 / Qwen3 (and Hermes) chat templates:

    <tool_call>
    {"name": "image_zoom_in", "arguments": {"bbox_2d": [10, 20, 200, 240]}}
    </tool_call>

several per turn, each a JSON object with a string `name` and an object `arguments` (a JSON string holding an
object is accepted too, as some models write it).

`pyvision`, the format PyVision's checkpoints write: code in a Markdown block inside `<code>` tags (a bare
```python block is read too), the final answer in `<answer>...</answer>`:

    <code>
    ```python
    print(image_clue_0.size)
    ```
    </code>

The turn's last block is one call of the `python` tool (`{"code": ...}`); a turn with a closed
`<answer>...</answer>` makes no call (it ends the trajectory, whatever else it holds); a turn with neither gets an
error call, so the model is told "No Python code or final answer found" and goes on, as PyVision tells it.
Its replies are PyVision's `<interpreter>` observations (`parser.reply_format`, `rl360.agents.replies`), and
`</code>` closes a call.

A parser may name how its replies are shown (`parser.reply_format`, see `rl360.agents.replies`); the default is
one `tool` message per call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rl360.agents.replies import interpreter_messages
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


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_JSON = json.JSONDecoder()


@register_parser("hermes")
def parse_hermes(text: str) -> ParseResult:
    """Qwen/Hermes `<tool_call>{json}</tool_call>` blocks. As vLLM's and SGLang's Hermes parsers read them: the
    turn's content is the text before its first call (text between or after calls is not content), and a
    `</tool_call>` inside a JSON string does not end the call (the JSON object is read whole first). An unclosed
    last block is read to the end of the text (a turn cut by the length limit): a call if its JSON is complete,
    else an error."""
    first = text.find(_OPEN)
    if first < 0:
        return ParseResult((), text.strip())
    calls, at = [], first
    while at >= 0:
        call, end = _hermes_block(text, at)
        calls.append(call)
        at = text.find(_OPEN, end)
    return ParseResult(tuple(calls), text[:first].strip())


parse_hermes.call_end = _CLOSE


def _hermes_block(text: str, at: int) -> tuple[ToolCall, int]:
    """The call of the block opened at `at`, and where the block ends."""
    start = at + len(_OPEN)
    body_start = len(text) - len(text[start:].lstrip())
    try:
        data, stop = _JSON.raw_decode(text, body_start)
    except json.JSONDecodeError:
        data, stop = None, body_start
    rest = text[stop:].lstrip()
    if isinstance(data, dict) and (rest.startswith(_CLOSE) or not rest):
        end = len(text) - len(rest) + (len(_CLOSE) if rest else 0)
        return _hermes_call(text[body_start:stop], True, text[at:end]), end
    close = text.find(_CLOSE, start)  # not one JSON object then the close: up to the first close, an error
    end = len(text) if close < 0 else close + len(_CLOSE)
    return _hermes_call(text[start:end - (len(_CLOSE) if close >= 0 else 0)].strip(), close >= 0, text[at:end]), end


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


_ANSWER = re.compile(r"<answer>.*?</answer>", re.DOTALL)
_FENCE = re.compile(r"```python[ \t]*\n?(.*?)(```|\Z)", re.DOTALL)
_CODE_TAG = re.compile(r"<code>(.*?)(</code>|\Z)", re.DOTALL)
NO_CODE = "No Python code or final answer found. There is something wrong with the format."


@register_parser("pyvision")
def parse_pyvision(text: str) -> ParseResult:
    """PyVision's `<code>```python ...```</code>` blocks (or bare ```python blocks): the last one is a `python`
    call; a closed `<answer>` means no call; neither is an error call (see the module docstring). A block whose
    Markdown fence is not closed, or a `<code>` block without a ```python block in it, is an error call."""
    if _ANSWER.search(text):
        return ParseResult((), text.strip())
    tagged = list(_CODE_TAG.finditer(text))
    fences = list(_FENCE.finditer(text))
    if not tagged and not fences:
        return ParseResult((ToolCall("", {}, NO_CODE, ""),), text.strip())
    last_fence = fences[-1] if fences else None
    last_tag = tagged[-1] if tagged else None
    if last_tag is not None and (last_fence is None or last_fence.start() < last_tag.start()):
        # the last <code> block holds no ```python block of its own
        raw = last_tag.group(0)
        return ParseResult((ToolCall("python", {}, "the <code> block holds no ```python ... ``` block", raw),),
                           text.replace(raw, "", 1).strip())
    assert last_fence is not None
    raw, closed = last_fence.group(0), bool(last_fence.group(2))
    if last_tag is not None and last_tag.start() <= last_fence.start() < last_tag.end():
        raw = last_tag.group(0)  # the block with its <code> tags
    content = text.replace(raw, "", 1).strip()
    if not closed:
        return ParseResult((ToolCall("python", {}, "the ```python block is not closed with ```", raw),), content)
    code = last_fence.group(1).strip()
    if not code:
        return ParseResult((ToolCall("python", {}, "the ```python block is empty", raw),), content)
    return ParseResult((ToolCall("python", {"code": code}, "", raw),), content)


parse_pyvision.call_end = "</code>"
parse_pyvision.reply_format = interpreter_messages
