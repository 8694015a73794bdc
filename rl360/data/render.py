"""Chat-template rendering of prompts (with their images, for a vision-language model) and the prompt-length
filter."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from rl360.core import ImagePrompt, Prompt
from rl360.data.images import VisionProcessor, is_vision_model, row_images, row_where
from rl360.data.schema import DataError


class PromptRenderer:
    """Renders chat messages to token ids with the chat template and the generation prompt.

    With a `VisionProcessor` (a Qwen2-VL / Qwen2.5-VL model), a row with images renders to an `ImagePrompt`: its
    ids with every image expanded to the image's tokens, and the images still compressed. `fits` is the length
    filter for PromptStream(filter_fn=...), on those expanded ids. Nothing is cached: a row is rendered again
    when its batch is built (an image's token count needs only its header).
    """

    def __init__(self, tokenizer: Any, max_prompt_length: int, vision: VisionProcessor | None = None):
        if max_prompt_length < 1:
            raise ValueError(f"max_prompt_length={max_prompt_length}; it must be at least 1")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.vision = vision

    @classmethod
    def for_model(cls, model_dir: str | os.PathLike, tokenizer: Any, max_prompt_length: int,
                  min_pixels: int | None = None, max_pixels: int | None = None) -> PromptRenderer:
        """The renderer of a Hugging Face model directory: with its vision processor when its config.json is a
        Qwen2-VL / Qwen2.5-VL model (`min_pixels` / `max_pixels` override its image processor's bounds),
        text-only otherwise."""
        vision = VisionProcessor.from_pretrained(model_dir, tokenizer, min_pixels, max_pixels) \
            if is_vision_model(model_dir) else None
        return cls(tokenizer, max_prompt_length, vision)

    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of text-only `messages` under the chat template, ending with the assistant generation prompt
        (the vision processor's template for a vision model)."""
        if self.vision is not None:
            return self.vision.render(messages)
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return _token_ids(encoded)

    def prompt(self, row: Mapping[str, Any]) -> Prompt:
        """What an engine samples from for a prompt row: an `ImagePrompt` for a row with images, its token ids
        otherwise. A row with images for a text-only model is a DataError naming its file and row."""
        images = row_images(row)
        if not images:
            return self.render(row["prompt"])
        where = row_where(row)
        if self.vision is None:
            raise DataError(f"{where}: the row has {len(images)} image(s) but the model is text-only (its config.json "
                            "is not a Qwen2-VL / Qwen2.5-VL model); drop the images or use a vision-language model")
        return ImagePrompt(self.vision.render(row["prompt"], images, where), images)

    def fits(self, row: Mapping[str, Any]) -> bool:
        """Whether the rendered row (images expanded to their tokens) has at most max_prompt_length tokens."""
        return len(self.prompt(row)) <= self.max_prompt_length


def _token_ids(encoded: Any) -> list[int]:
    """A flat list of ints from either convention: a list of ids, or a BatchEncoding/dict with input_ids."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded.input_ids
    if hasattr(encoded, "tolist"):  # a tensor or array
        encoded = encoded.tolist()
    if isinstance(encoded, Sequence) and len(encoded) == 1 and isinstance(encoded[0], Sequence):
        encoded = encoded[0]  # a batch of one conversation
    return [int(token) for token in encoded]
