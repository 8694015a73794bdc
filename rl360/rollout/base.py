"""What the rollout manager needs from any engine: sampling settings, the samples, weight buckets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class SamplingParams:
    n: int = 1  # responses per prompt
    temperature: float = 1.0  # 0: greedy (the most likely token at every step)
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)  # generation ends after any of these
    seed: int = 0  # seeds this call's sampling


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


@dataclass
class Sample:
    """One sampled response: its prompt, its tokens and the engine's log-prob of each token."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token was sampled), "length" (max_new_tokens) or "abort"
    weight_version: int = 0  # the weights that sampled its first token (the trainer step they come from)
    # per response token, when a partial rollout was continued under newer weights (None: all weight_version)
    token_versions: list[int] | None = None
    resumed: int = 0  # times it was continued after an abort
    images: tuple[bytes, ...] | None = None  # the prompt's compressed images (None: a text prompt)

    @property
    def status(self) -> str:
        """completed (ended by a stop token), truncated (by the length limit) or aborted."""
        return {"stop": "completed", "length": "truncated"}.get(self.finish_reason, "aborted")

    def versions(self) -> list[int]:
        """The weight version that sampled each response token."""
        return self.token_versions or [self.weight_version] * len(self.response_ids)

    def continued(self, more: Sample) -> Sample:
        """This aborted sample followed by `more`, sampled from `prompt_ids + response_ids` (maybe by newer
        weights): tokens, log-probs and versions appended, `more`'s finish reason."""
        versions = self.versions() + more.versions()
        return Sample(self.prompt_ids, self.response_ids + more.response_ids, self.logprobs + more.logprobs,
                      more.finish_reason, self.weight_version if self.response_ids else more.weight_version,
                      versions if len(set(versions)) > 1 else None, self.resumed + 1, self.images)

    def continuation(self) -> Prompt:
        """The prompt that continues this sample: its prompt and response tokens, with the prompt's images."""
        ids = self.prompt_ids + self.response_ids
        return ImagePrompt(ids, self.images) if self.images else ids


WeightBucket = list[tuple[str, torch.Tensor]]


class RolloutEngine(Protocol):
    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[list[Sample]]:
        """`params.n` samples for each prompt, in prompt order (an `ImagePrompt`'s samples carry its images)."""

    def update_weights(self, bucket: WeightBucket, version: int) -> None:
        """Load one bucket of `(hf_name, tensor)` into the engine's model, part of weight `version`."""

    def finish_weight_update(self, version: int) -> int:
        """Check that every parameter was loaded for `version`; return the version now served."""

    def health(self) -> dict:
        """A small status dict (version served, device, ...)."""
