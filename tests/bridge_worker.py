"""Bridge ranks for tests/test_bridge_parallel.py, started by `rl360.cluster.launch.run_ranks`."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megatron_bridge import Bridge
from rl360.actor.parallel import destroy_parallel, init_parallel


def token_ids() -> torch.Tensor:
    """[2, 40] fixed token ids below the tiny models' vocabulary of 99."""
    return torch.randint(0, 99, (2, 40), generator=torch.Generator().manual_seed(7))


def pipeline_logits(models: list, ids: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Logits over the real vocabulary through megatron's own pipeline schedule (forward only), gathered
    over tensor-parallel ranks; None on ranks other than the last stage."""
    positions = torch.arange(ids.shape[1]).expand_as(ids[:1])
    return _forward_only(models, ids, vocab_size, lambda model, rows: model(rows, positions.expand_as(rows), None))


def _forward_only(models: list, ids: torch.Tensor, vocab_size: int, forward) -> torch.Tensor | None:
    """`forward(model, rows)` run by megatron's schedule on `ids` as one micro-batch, or with virtual pipeline
    chunks (which need as many micro-batches as stages) one row each; the last stage's gathered logits."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    micro = [ids] if len(models) == 1 else list(ids.split(1))

    def forward_step(data_iterator, model):
        rows = next(data_iterator)
        return forward(model, rows), lambda out, non_loss_data=True: gather_from_tensor_model_parallel_region(out)

    for model in models:
        model.eval()
    data = iter(micro) if len(models) == 1 else [iter(micro) for _ in models]
    with torch.no_grad():
        out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data, model=models,
                                          num_microbatches=len(micro), seq_length=ids.shape[1],
                                          micro_batch_size=micro[0].shape[0], forward_only=True,
                                          collect_non_loss_data=True)
    if not parallel_state.is_pipeline_last_stage():
        return None
    return torch.cat(out)[..., :vocab_size].float()


def export_all(bridge: Bridge, models: list, bucket_bytes: int = 30_000) -> dict[str, torch.Tensor]:
    return {name: tensor for bucket in bridge.export_hf_weights(models, bucket_bytes=bucket_bytes)
            for name, tensor in bucket}


def export_and_logits(hf_dir: str, out_dir: str, tp: str, pp: str, ep: str = "1", save: str = "0",
                      vpp: str = "1") -> None:
    """Load `hf_dir` at TP x PP (x EP, x VPP chunks); every rank writes what it exported; the last stage writes
    the logits; with `save` "1" the ranks also save the model to `out_dir`/saved."""
    export_and_logits_case(hf_dir, out_dir, tp, pp, ep, save, vpp)
    destroy_parallel()


def export_and_logits_case(hf_dir: str, out_dir: str, tp: str, pp: str, ep: str = "1", save: str = "0",
                           vpp: str = "1") -> None:
    """`export_and_logits` leaving the parallel state up (`tests.rank_cases` tears it down between cases)."""
    init_parallel(int(tp), int(pp), expert_parallel=int(ep), virtual_pipeline=int(vpp))
    rank = dist.get_rank()
    bridge = Bridge.from_hf_pretrained(hf_dir)
    models = bridge.to_megatron_model(load_weights=True)
    save_file(export_all(bridge, models), f"{out_dir}/exported_rank{rank}.safetensors")
    (Path(out_dir) / f"parameters_rank{rank}.txt").write_text(str(sum(p.numel() for p in models[0].parameters())))
    if save == "1":
        bridge.save_hf_pretrained(models, f"{out_dir}/saved", max_shard_bytes=100_000)
    logits = pipeline_logits(models, token_ids(), bridge.vocab_size)
    if logits is not None:
        torch.save(logits, f"{out_dir}/logits_rank{rank}.pt")


def vision_batch(hf_dir: str, multiple: int = 2) -> dict:
    """Two image+text rows for a tiny Qwen-VL model, right-padded to a `multiple`: one image, then two images of
    other sizes; their token ids, lengths, images per row and the processor's pixel inputs (every image in row
    order)."""
    from rl360.data.images import VisionProcessor
    from tests.helpers import png_bytes

    processor = VisionProcessor.from_pretrained(hf_dir)
    images = [png_bytes(56, 56, (200, 30, 0)), png_bytes(84, 56, (0, 160, 40)), png_bytes(28, 84, (20, 20, 220))]
    rows = [processor.render([{"role": "user", "content": "<image> What colour?"}], images[:1]),
            processor.render([{"role": "user", "content": "<image> What colour? <image>"}], images[1:])]
    width = max(map(len, rows))
    ids = torch.zeros(2, width + (-width) % multiple, dtype=torch.long)
    for row, tokens in enumerate(rows):
        ids[row, :len(tokens)] = torch.tensor(tokens)
    return {"ids": ids, "lengths": [len(r) for r in rows], "images_per_row": [1, 2],
            **processor.pixel_inputs(images), "merge_size": processor.merge_size}


def vision_pipeline_logits(models: list, bridge: Bridge, batch: dict) -> torch.Tensor | None:
    """`pipeline_logits` of a `vision_batch`: M-RoPE positions on every stage, pixels on the first."""
    from megatron_bridge.mrope import batch_mrope_positions

    ids = batch["ids"]
    positions = batch_mrope_positions(ids, batch["lengths"], batch["image_grid_thw"], batch["images_per_row"],
                                      bridge.image_token_id, batch["merge_size"])
    return _forward_only(models, ids, bridge.vocab_size, lambda model, rows: model(
        rows, positions, None, pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"]))


def export_and_vision_logits(hf_dir: str, out_dir: str, tp: str, pp: str, sequence_parallel: str = "0") -> None:
    """`export_and_logits` for a vision-language model on its `vision_batch`."""
    init_parallel(int(tp), int(pp))
    rank = dist.get_rank()
    bridge = Bridge.from_hf_pretrained(hf_dir)
    models = bridge.to_megatron_model(load_weights=True, training={"sequence_parallel": sequence_parallel == "1"})
    save_file(export_all(bridge, models), f"{out_dir}/exported_rank{rank}.safetensors")
    logits = vision_pipeline_logits(models, bridge, vision_batch(hf_dir))
    if logits is not None:
        torch.save(logits, f"{out_dir}/logits_rank{rank}.pt")
    destroy_parallel()


def build_with_context_parallel(hf_dir: str) -> None:
    init_parallel(1, 1, context_parallel=2)
    Bridge.from_hf_pretrained(hf_dir).to_megatron_model(load_weights=False)
