"""Multimodal RoPE (M-RoPE) of Qwen2-VL / Qwen2.5-VL: 3-D positions and the rotary table they index.

Every token has three positions (temporal, height, width). Text tokens carry the same value on all three,
counting on from the previous token; an image's tokens (one per merged patch, row-major over the merged
grid) carry (start, start + row, start + column), where `start` is the position after the text before it,
and the text after an image resumes at start + max(rows, columns). The rotary frequencies are split in
three sections (`mrope_section`, pairs of channels): the first follows the temporal position, the next the
height, the last the width.

`MRoPE` replaces megatron-core's `MultimodalRotaryEmbedding`, which allocates its frequencies on a CUDA
device when built and so cannot run on CPU; it returns the same [T, B, 1, head_dim] table.
"""

from __future__ import annotations

import torch


def mrope_positions(input_ids: torch.Tensor, image_grids: torch.Tensor, image_token_id: int,
                    merge_size: int, text_from: int | None = None) -> torch.Tensor:
    """[3, L] M-RoPE positions of one sequence `input_ids` [L] whose images, in order, have the patch grids
    `image_grids` [N, 3] (t, h, w before merging, as the image processor reports them). Each image is one
    contiguous run of `image_token_id` tokens, (t * h * w) / merge_size**2 long. Tokens from `text_from` on
    (a sampled response) are text whatever their id, as the engines that sampled them saw them."""
    ids = input_ids.tolist()
    if text_from is not None:  # a response that sampled the image token: text there (-1 is no token id)
        ids = ids[:text_from] + [-1] * (len(ids) - text_from)
    pieces: list[torch.Tensor] = []
    position, index, image = 0, 0, 0
    while index < len(ids):
        if ids[index] != image_token_id:
            end = index
            while end < len(ids) and ids[end] != image_token_id:
                end += 1
            pieces.append((torch.arange(end - index) + position).expand(3, -1))
            position += end - index
            index = end
            continue
        if image >= len(image_grids):
            raise ValueError(f"more image runs in the sequence than the {len(image_grids)} image grid(s) given")
        t, h, w = (int(x) for x in image_grids[image])
        rows, columns = h // merge_size, w // merge_size
        count = t * rows * columns
        if ids[index:index + count] != [image_token_id] * count:
            raise ValueError(f"image {image} (grid {t}x{h}x{w}) needs {count} image tokens from position {index}")
        grid_t, grid_h, grid_w = torch.meshgrid(torch.arange(t), torch.arange(rows), torch.arange(columns),
                                                indexing="ij")
        pieces.append(torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + position)
        position += max(rows, columns)
        index += count
        image += 1
    if image != len(image_grids):
        raise ValueError(f"{len(image_grids)} image grid(s) given but the sequence holds {image} image(s)")
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.long)
    return torch.cat(pieces, dim=1).to(device=input_ids.device, dtype=torch.long)


def batch_mrope_positions(input_ids: torch.Tensor, lengths: list[int], image_grids: torch.Tensor,
                          images_per_sequence: list[int], image_token_id: int, merge_size: int,
                          prompt_lengths: list[int] | None = None) -> torch.Tensor:
    """[3, B, T] positions of `input_ids` [B, T] holding one sequence per row (its first `lengths[b]` tokens),
    or of a packed [1, T] row holding the sequences back to back in slots of `lengths` tokens; each sequence's
    images are the next `images_per_sequence[k]` rows of `image_grids`. Positions past a sequence's tokens
    (padding) count on, as text, and so do those past `prompt_lengths[k]` (see `mrope_positions`)."""
    rows, width = input_ids.shape
    packed = rows == 1 and len(lengths) > 1
    out = torch.empty(3, rows, width, dtype=torch.long, device=input_ids.device)
    first_grid, start = 0, 0
    for k, (length, count) in enumerate(zip(lengths, images_per_sequence)):
        row, begin = (0, start) if packed else (k, 0)
        grids = image_grids[first_grid:first_grid + count]
        first_grid += count
        end = begin + length if packed else width
        text_from = prompt_lengths[k] if prompt_lengths is not None else None
        out[:, row, begin:end] = mrope_positions(input_ids[row, begin:end], grids, image_token_id, merge_size,
                                                 text_from)
        start += length
    return out


class MRoPE(torch.nn.Module):
    """Rotary table for [3, B, T] positions: [T, B, 1, head_dim] (megatron's layout; the frequencies of each
    section taken from its axis, both halves of the rotation alike)."""

    def __init__(self, head_dim: int, mrope_section: list[int], base: float):
        super().__init__()
        if 2 * sum(mrope_section) != head_dim:
            raise ValueError(f"mrope_section={mrope_section} must sum to head_dim / 2 = {head_dim // 2}")
        self.mrope_section = list(mrope_section)
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        axis = torch.cat([torch.full((n,), a, dtype=torch.long) for a, n in enumerate(mrope_section)])
        self.register_buffer("axis", axis, persistent=False)

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int] | None = None, cp_group=None):
        """`mrope_section` and `cp_group` are megatron's call signature; the section is fixed at build time and
        context parallelism is refused for vision-language models (see `VisionLanguageModel`)."""
        freqs = position_ids.to(self.inv_freq.device, torch.float32)[..., None] * self.inv_freq  # [3, B, T, d/2]
        freqs = freqs.gather(0, self.axis.expand(1, *freqs.shape[1:])).squeeze(0)  # [B, T, d/2]: axis per pair
        table = torch.cat([freqs, freqs], dim=-1)  # [B, T, d]
        return table.transpose(0, 1)[:, :, None, :].contiguous()
