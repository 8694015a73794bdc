"""`VisionLanguageModel`: a megatron-core GPTModel whose first pipeline stage also holds the vision tower.

The language model is the bridge's GPTModel unchanged (its parameter names, TP/PP sharding and checkpoints),
with M-RoPE instead of 1-D RoPE; on the first stage `vision` (transformers' tower, see `vision.py`) turns
the micro-batch's pixel patches into one embedding per image token, and those replace the word embeddings
at the image tokens' places, in order. With sequence parallelism each tensor-parallel rank keeps its part
of the sequence, the image embeddings included (their gradients are gathered back, so every rank's
replica of the tower gets the whole gradient). Context parallelism is refused: a rank's slice of a
sequence would hold an arbitrary part of an image's tokens.
"""

from __future__ import annotations

import torch

from megatron_bridge.mrope import MRoPE


def vision_language_model_class():
    """The class, built on first use so that importing the bridge does not import megatron-core."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    class VisionLanguageModel(GPTModel):
        def __init__(self, config, transformer_layer_spec, *, vision_tower: torch.nn.Module | None,
                     mrope_section: list[int], image_token_id: int, **kwargs):
            if config.context_parallel_size > 1:
                raise ValueError("vision-language models do not support context parallelism "
                                 f"(actor.parallel.context={config.context_parallel_size}): use tensor, pipeline "
                                 "and sequence parallelism")
            kwargs["position_embedding_type"] = "rope"  # (replaced below)
            super().__init__(config, transformer_layer_spec, **kwargs)
            # megatron's "mrope" embedding allocates on CUDA when built; ours computes the same table anywhere
            self.position_embedding_type = "mrope"
            self.mrope_section = list(mrope_section)
            self.rotary_pos_emb = MRoPE(config.kv_channels, self.mrope_section, kwargs.get("rotary_base", 10000))
            self.image_token_id = image_token_id
            if self.pre_process:
                self.vision = vision_tower

        def forward(self, input_ids, position_ids, attention_mask, *args, pixel_values=None,
                    image_grid_thw=None, image_mask=None, **kwargs):
            """GPTModel's forward with `position_ids` [3, B, T]; on the first stage, `pixel_values` (every patch
            of the micro-batch's images, in the order their tokens appear row by row), `image_grid_thw` and
            `image_mask` [B, T], the tokens the images fill (default: every image token; a response that
            sampled the image token's id is text)."""
            if self.pre_process and pixel_values is not None and kwargs.get("decoder_input") is None:
                if image_mask is None:
                    image_mask = input_ids == self.image_token_id
                kwargs["decoder_input"] = self._embed_with_images(input_ids, pixel_values, image_grid_thw,
                                                                  image_mask)
            return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)

        def _embed_with_images(self, input_ids, pixel_values, image_grid_thw, is_image):
            text = self.embedding(input_ids=input_ids, position_ids=None)  # [S, B, H] (S / tp with SP)
            tower_dtype = next(self.vision.parameters()).dtype
            images = self.vision(pixel_values.to(tower_dtype), grid_thw=image_grid_thw).pooler_output
            if int(is_image.sum()) != images.shape[0]:
                raise ValueError(f"the micro-batch holds {int(is_image.sum())} image tokens but its "
                                 f"{len(image_grid_thw)} image(s) give {images.shape[0]} embeddings")
            placed = torch.zeros(*input_ids.shape, images.shape[-1], dtype=text.dtype, device=text.device)
            placed = placed.masked_scatter(is_image[..., None], images.to(text.dtype)).transpose(0, 1)
            mask = is_image.transpose(0, 1)[..., None]  # [S, B, 1]
            if self.config.sequence_parallel:
                placed = tensor_parallel.scatter_to_sequence_parallel_region(placed)
                mask = _sequence_part(mask)
            return torch.where(mask, placed, text)

    return VisionLanguageModel


def _sequence_part(tensor: torch.Tensor) -> torch.Tensor:
    """This tensor-parallel rank's slice of a [S, ...] tensor along S (sequence parallelism's split)."""
    from megatron.core import parallel_state

    size = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    per = tensor.shape[0] // size
    return tensor[rank * per:(rank + 1) * per]
