"""What engines sample from: token ids, or token ids with images."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with images. `ids`: its token ids with each image's placeholder already expanded to that
    image's tokens (the model's image-pad token repeated once per merged patch, as the model's processor
    renders it: what the trainer trains on); `images`: the prompt's images in order, still compressed
    (PNG/JPEG bytes, decoded only where pixels are needed)."""

    ids: list[int]
    images: tuple[bytes, ...]

    def __len__(self) -> int:
        return len(self.ids)


Prompt = list[int] | ImagePrompt  # what engines sample from: token ids, or token ids with images


def prompt_ids(prompt: Prompt) -> list[int]:
    """The token ids of a prompt of either kind."""
    return prompt.ids if isinstance(prompt, ImagePrompt) else prompt


def prompt_images(prompt: Prompt) -> tuple[bytes, ...] | None:
    """The compressed images of a prompt (None for a text prompt)."""
    return prompt.images if isinstance(prompt, ImagePrompt) else None
