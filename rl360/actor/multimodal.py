"""What a vision-language policy's forward takes beyond token ids, for one micro-batch.

Every pipeline stage needs the M-RoPE positions ([3, B, T]), which depend on each image's patch grid: those
come from the images' headers (no decoding). Only the first stage, which holds the vision tower, decodes the
micro-batch's images into pixel patches. The images of a micro-batch are taken row by row, so they follow
their tokens in the padded rows and in a packed row alike.

A row's images are its prompt's, then those a tool added inside the response (a multi-turn trajectory), in
order. Their image tokens are the image-token ids the engine did not sample: in the prompt, and in the
response's inserted tokens (those out of the loss, `response_mask` 0, before the row's last trained token).
A token the engine sampled is text whatever its id, as the engines embedded it.
"""

from __future__ import annotations

import torch

from megatron_bridge.mrope import batch_mrope_positions
from rl360.actor.batch import RolloutBatch
from rl360.data.images import VisionProcessor


class MultimodalInputs:
    def __init__(self, processor: VisionProcessor, image_token_id: int, first_stage: bool):
        self.processor = processor
        self.image_token_id = image_token_id
        self.first_stage = first_stage

    def positions(self, mb: RolloutBatch, input_ids: torch.Tensor, packed_lengths: list[int] | None) -> torch.Tensor:
        """[3, B, T] positions of `input_ids` (the micro-batch `mb` padded, or packed in slots of
        `packed_lengths`)."""
        images = self._row_images(mb)
        grids = [self.processor.image_grid(data, f"row {row} image {k}")
                 for row, row_images in enumerate(images) for k, data in enumerate(row_images)]
        grid_tensor = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        lengths = packed_lengths or [input_ids.shape[1]] * len(mb)
        ids = input_ids.cpu()
        ids = torch.where(self.image_tokens(mb, ids, packed_lengths) | (ids != self.image_token_id), ids, -1)
        return batch_mrope_positions(ids, lengths, grid_tensor, [len(row) for row in images], self.image_token_id,
                                     self.processor.merge_size).to(input_ids.device)

    def model_inputs(self, mb: RolloutBatch, input_ids: torch.Tensor, packed_lengths: list[int] | None,
                     device: torch.device) -> dict[str, torch.Tensor]:
        """The first stage's `pixel_values`, `image_grid_thw` and `image_mask` (`image_tokens`); nothing
        elsewhere, or for a micro-batch without images."""
        flat = [data for row in self._row_images(mb) for data in row]
        if not self.first_stage or not flat:
            return {}
        pixels = self.processor.pixel_inputs(flat)
        return {"pixel_values": pixels["pixel_values"].to(device),
                "image_grid_thw": pixels["image_grid_thw"].to(device),
                "image_mask": self.image_tokens(mb, input_ids, packed_lengths)}

    def image_tokens(self, mb: RolloutBatch, input_ids: torch.Tensor,
                     packed_lengths: list[int] | None) -> torch.Tensor:
        """[B, T] (or [1, T] packed) True at the image tokens the images fill: image-token ids the engine did not
        sample (the prompt's, and those of tool replies inside the response)."""
        device = input_ids.device
        starts, mask = mb.response_start.to(device), (mb.response_mask > 0).to(device)
        if packed_lengths is None:
            rows = torch.arange(len(mb), device=device)[:, None].expand(-1, input_ids.shape[1])
            offset = torch.arange(input_ids.shape[1], device=device)[None, :].expand_as(rows)
        else:
            slots = torch.tensor(packed_lengths, device=device)
            rows = torch.repeat_interleave(torch.arange(len(mb), device=device), slots)[None, :]
            offset = torch.arange(input_ids.shape[1], device=device)[None, :] - \
                torch.repeat_interleave(torch.cumsum(slots, 0) - slots, slots)[None, :]
        index = offset - starts[rows]  # the response token at each position (negative: the prompt)
        sampled = (index >= 0) & (index < mask.shape[1]) & mask[rows, index.clamp(0, mask.shape[1] - 1)]
        return (input_ids == self.image_token_id) & ~sampled

    @staticmethod
    def _row_images(mb: RolloutBatch) -> list[tuple[bytes, ...]]:
        return mb.images if mb.images is not None else [()] * len(mb)
