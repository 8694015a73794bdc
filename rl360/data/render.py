"""Chat-template rendering of prompts and the prompt-length filter."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class PromptRenderer:
    """Renders chat messages to token ids with the tokenizer's chat template and the generation prompt.

    `fits` is the length filter for PromptStream(filter_fn=...). Nothing is cached: a row is rendered
    again when its batch is built.
    """

    def __init__(self, tokenizer: Any, max_prompt_length: int):
        if max_prompt_length < 1:
            raise ValueError(f"max_prompt_length={max_prompt_length}; it must be at least 1")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length

    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of `messages` under the chat template, ending with the assistant generation prompt."""
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return _token_ids(encoded)

    def fits(self, row: dict[str, Any]) -> bool:
        """Whether the rendered `row["prompt"]` has at most max_prompt_length tokens."""
        return len(self.render(row["prompt"])) <= self.max_prompt_length


def _token_ids(encoded: Any) -> list[int]:
    """A flat list of ints from either convention: a list of ids, or a BatchEncoding/dict with input_ids."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded.input_ids
    if hasattr(encoded, "tolist"):  # a tensor or array
        encoded = encoded.tolist()
    if isinstance(encoded, Sequence) and len(encoded) == 1 and isinstance(encoded[0], Sequence):
        encoded = encoded[0]  # a batch of one conversation
    return [int(token) for token in encoded]
