"""Conversations for supervised fine-tuning, in verl's SFT formats, as token ids with a per-token loss mask.

A row is either
- multi-turn: `messages` (a list of `{role, content}` messages; an assistant message may carry `tool_calls`,
  `[{"type": "function", "function": {"name", "arguments"}}]`, and tool replies are `tool` messages), with the
  tools offered in `tools` (a list of JSON-schema function specs, or that list as a JSON string), or
- single-turn: `prompt` (a string, the user's message, or a list of messages) and `response` (a string, the
  assistant's reply).
The key names are settings (`sft.messages_key`, `sft.tools_key`, `sft.prompt_key`, `sft.response_key`).

The tokenizer's chat template renders the conversation message by message, as the agent loop renders a
trajectory (rl360/agents/loop.py): everything before the first assistant message, up to and including the
assistant header (`add_generation_prompt`), is the prompt; after it every piece is tokenized on its own and
the pieces joined, so each token belongs to exactly one message. An assistant message's tokens are trained on
(mask 1) as an engine would generate them: from after the assistant header to the end of its turn (the
end-of-turn token, `<|im_end|>` in ChatML); the whitespace the template writes after that token, the headers,
and every user, system and tool message are context (mask 0), as the tool replies in a trajectory are.

    tokens = ConversationTokens(tokenizer, SftKeys())
    ids = tokens(row, "train.parquet", 7)   # Tokenized(prompt_ids, response_ids, loss_mask)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rl360.data.schema import DataError, _short


@dataclass(frozen=True)
class SftKeys:
    """The columns of a row that hold its conversation."""

    messages: str = "messages"
    tools: str = "tools"
    prompt: str = "prompt"
    response: str = "response"


@dataclass(frozen=True)
class Tokenized:
    """One conversation: the prompt's ids, the ids after it, and the loss mask of those (1: an assistant token)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def conversation(row: dict[str, Any], keys: SftKeys, path: str, index: int) -> tuple[list[dict], list | None]:
    """The row's messages (keys with null values dropped, tool-call arguments as dicts) and its tools; a
    `DataError` naming the file, row and key when the row holds neither format or a message is malformed."""
    where = f"{path} row {index}"
    if row.get(keys.messages) is not None:
        messages = row[keys.messages]
        key = keys.messages
    elif row.get(keys.prompt) is not None or row.get(keys.response) is not None:
        prompt, response = row.get(keys.prompt), row.get(keys.response)
        if not isinstance(response, str):
            raise DataError(f"{where}: key {keys.response!r} must be the assistant's reply as a string, got "
                            f"{_short(response)}")
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        elif not isinstance(prompt, (list, tuple)):
            raise DataError(f"{where}: key {keys.prompt!r} must be a string or a list of {{role, content}} messages, "
                            f"got {_short(prompt)}")
        messages, key = [*prompt, {"role": "assistant", "content": response}], keys.prompt
    else:
        raise DataError(f"{where}: no conversation: the row has neither {keys.messages!r} (multi-turn) nor "
                        f"{keys.prompt!r} and {keys.response!r} (single-turn); its keys are {sorted(row)} (set "
                        "sft.messages_key, or sft.prompt_key and sft.response_key)")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataError(f"{where}: key {key!r} must be a non-empty list of messages, got {_short(messages)}")
    cleaned = [_message(message, f"{where}: key {key!r}[{number}]") for number, message in enumerate(messages)]
    if not any(message["role"] == "assistant" for message in cleaned):
        raise DataError(f"{where}: key {key!r} has no assistant message: nothing to train on")
    return cleaned, _tools(row.get(keys.tools), f"{where}: key {keys.tools!r}")


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise DataError(f"{where} must be a {{role, content}} message, got {_short(message)}")
    message = {name: value for name, value in message.items() if value is not None}
    if not isinstance(message.get("role"), str) or not message["role"]:
        raise DataError(f"{where}.role must be a non-empty string, got {_short(message.get('role'))}")
    content = message.setdefault("content", "")
    if not isinstance(content, str):
        raise DataError(f"{where}.content must be a string, got {_short(content)}")
    calls = message.get("tool_calls")
    if calls is not None:
        if message["role"] != "assistant" or not isinstance(calls, (list, tuple)):
            raise DataError(f"{where}.tool_calls must be a list, on an assistant message, got {_short(calls)}")
        message["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{number}]") for number, call in
                                 enumerate(calls)]
    return message


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """A call as chat templates read it: `{"type": "function", "function": {"name", "arguments": dict}}`."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise DataError(f"{where} must be {{type: function, function: {{name, arguments}}}}, got {_short(call)}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as err:
            raise DataError(f"{where}.function.arguments is a string that is not JSON ({err})") from None
    if not isinstance(arguments, dict):
        raise DataError(f"{where}.function.arguments must be an object, got {_short(arguments)}")
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _tools(tools: Any, where: str) -> list | None:
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as err:
            raise DataError(f"{where} is a string that is not JSON ({err})") from None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(tool, dict) for tool in tools):
        raise DataError(f"{where} must be a list of tool specs, got {_short(tools)}")
    return [_without_nulls(tool) for tool in tools] or None


def _without_nulls(value: Any) -> Any:
    """A parquet struct read back: the fields other rows' specs have (null here) dropped."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, (list, tuple)):
        return [_without_nulls(item) for item in value]
    return value


class ConversationTokens:
    """A row -> its `Tokenized` conversation, through `tokenizer`'s chat template (see the module docstring)."""

    def __init__(self, tokenizer: Any, keys: SftKeys):
        self.tokenizer, self.keys = tokenizer, keys

    def check_columns(self, path: str, schema: Any) -> None:
        """A parquet file's columns (its arrow `schema`) hold one of the formats: a `DataError` naming the file."""
        names = set(schema.names)
        if "images" in names:
            raise DataError(f"{path}: an 'images' column: rl360 sft trains on text conversations (images in them are "
                            "not built yet)")
        if self.keys.messages not in names and not {self.keys.prompt, self.keys.response} <= names:
            raise DataError(f"{path}: no conversation columns: neither {self.keys.messages!r} (multi-turn) nor "
                            f"{self.keys.prompt!r} and {self.keys.response!r} (single-turn); its columns are "
                            f"{sorted(names)} (set sft.messages_key, or sft.prompt_key and sft.response_key)")

    def check_row(self, row: dict[str, Any], path: str, index: int) -> None:
        """`conversation`'s checks (no tokenizing): a `DataError` for a row that holds no conversation."""
        if row.get("images"):
            raise DataError(f"{path} row {index}: key 'images': rl360 sft trains on text conversations (images in "
                            "them are not built yet)")
        conversation(row, self.keys, path, index)

    def __call__(self, row: dict[str, Any], path: str, index: int) -> Tokenized:
        messages, tools = conversation(row, self.keys, path, index)
        where = f"{path} row {index}"
        first = next(number for number, message in enumerate(messages) if message["role"] == "assistant")
        rendered = self._render(messages[:first], tools, True, where)
        prompt = self._encode(rendered)
        pieces: list[tuple[str, int]] = []  # (text, mask) after the prompt
        for number in range(first, len(messages)):
            done = rendered
            if messages[number]["role"] == "assistant":
                if number > first:
                    header = self._render(messages[:number], tools, True, where)
                    pieces.append((self._after(done, header, number, where), 0))
                    done = header
                rendered = self._render(messages[:number + 1], tools, False, where)
                turn = self._after(done, rendered, number, where)
                trained = turn.rstrip()  # the whitespace after the end-of-turn token is the template's, not the
                pieces += [(trained, 1), (turn[len(trained):], 0)]  # model's: an engine stops at that token
            else:
                rendered = self._render(messages[:number + 1], tools, False, where)
                pieces.append((self._after(done, rendered, number, where), 0))
        response, mask = [], []
        for text, trained in pieces:
            ids = self._encode(text) if text else []
            response += ids
            mask += [trained] * len(ids)
        return Tokenized(prompt, response, mask)

    def _render(self, messages: list[dict], tools: list | None, generation_prompt: bool, where: str) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as err:  # jinja's errors: a template that cannot render these messages
            raise DataError(f"{where}: the chat template cannot render the conversation ({type(err).__name__}: "
                            f"{err})") from None

    @staticmethod
    def _after(before: str, rendered: str, number: int, where: str) -> str:
        """What rendering message `number` added to `before`; a `DataError` when the template rendered the
        earlier messages differently once it followed them (then no mask can be cut from the rendering)."""
        if not rendered.startswith(before):
            raise DataError(f"{where}: the chat template renders the messages before message {number} differently "
                            "once it follows them (e.g. Qwen3's drops earlier turns' reasoning): per-turn loss masks "
                            "need a template that renders every message as it is")
        return rendered[len(before):]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)
