"""megatron_bridge for Qwen2-VL and Qwen2.5-VL: M-RoPE positions equal transformers', HF -> megatron -> HF
round trips are bitwise and logits on image+text batches match transformers (1e-4, fp32), at TP=1 and at
TP=2 x PP=2 (4 gloo processes), tied and untied as the families ship, and with sequence parallelism."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from megatron_bridge import Bridge
from megatron_bridge.mrope import MRoPE, batch_mrope_positions, mrope_positions
from rl360.cluster.launch import run_ranks
from rl360.quickstart.vision_assets import build_vision_quickstart_model
from tests.bridge_worker import export_all, vision_batch, vision_pipeline_logits
from tests.helpers import assert_every_rank_exported_the_checkpoint

TEXTS = ["What colour?"]


@pytest.fixture(scope="module", params=[("qwen2_5_vl", True), ("qwen2_5_vl", False), ("qwen2_vl", True),
                                        ("qwen2_vl", False)], ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}")
def tiny_vl(request, tmp_path_factory):
    family, tied = request.param
    out = tmp_path_factory.mktemp(f"{family}_{tied}")
    return str(build_vision_quickstart_model(out, TEXTS, seed=4, family=family, tie_word_embeddings=tied))


def _reference_logits(hf_dir: str, batch: dict) -> torch.Tensor:
    """transformers' logits of each row of a `vision_batch`, run alone (no padding), padded back to [B, T, V]."""
    model = AutoModelForImageTextToText.from_pretrained(hf_dir).eval()
    image_token = model.config.image_token_id
    out, first = [], 0
    for row, (length, count) in enumerate(zip(batch["lengths"], batch["images_per_row"])):
        ids = batch["ids"][row:row + 1, :length]
        grids = batch["image_grid_thw"][first:first + count]
        patches = int(batch["image_grid_thw"][:first].prod(-1).sum())
        pixels = batch["pixel_values"][patches:patches + int(grids.prod(-1).sum())]
        first += count
        with torch.no_grad():
            logits = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
                           mm_token_type_ids=(ids == image_token).int()).logits[0]
        out.append(torch.nn.functional.pad(logits, (0, 0, 0, batch["ids"].shape[1] - length)))
    return torch.stack(out)


def _assert_rows_close(ours: torch.Tensor, theirs: torch.Tensor, lengths: list[int]) -> None:
    assert ours.shape == theirs.shape
    for row, length in enumerate(lengths):
        assert (ours[row, :length] - theirs[row, :length]).abs().max().item() <= 1e-4, row


def test_mrope_positions_equal_transformers_rope_index(tiny_vl):
    batch = vision_batch(tiny_vl)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl)
    image_token = model.config.image_token_id
    ids, mask = batch["ids"], torch.zeros_like(batch["ids"])
    for row, length in enumerate(batch["lengths"]):
        mask[row, :length] = 1
    expected, _ = model.model.get_rope_index(ids, (ids == image_token).int(), image_grid_thw=batch["image_grid_thw"],
                                             attention_mask=mask)
    ours = batch_mrope_positions(ids, batch["lengths"], batch["image_grid_thw"], batch["images_per_row"],
                                 image_token, batch["merge_size"])
    for row, length in enumerate(batch["lengths"]):
        assert torch.equal(ours[:, row, :length], expected[:, row, :length]), row


def test_packed_positions_restart_in_each_sequence(tiny_vl):
    batch = vision_batch(tiny_vl)
    token = Bridge.from_hf_pretrained(tiny_vl).image_token_id
    lengths = batch["lengths"]
    packed = torch.cat([batch["ids"][row, :n] for row, n in enumerate(lengths)])[None]
    ours = batch_mrope_positions(packed, lengths, batch["image_grid_thw"], batch["images_per_row"], token, 2)
    padded = batch_mrope_positions(batch["ids"], lengths, batch["image_grid_thw"], batch["images_per_row"], token, 2)
    assert torch.equal(ours[:, 0, :lengths[0]], padded[:, 0, :lengths[0]])
    assert torch.equal(ours[:, 0, lengths[0]:], padded[:, 1, :lengths[1]])


def test_mrope_positions_refuse_a_grid_that_does_not_fit_the_tokens():
    ids = torch.tensor([1, 5, 5, 5, 2])
    with pytest.raises(ValueError, match="needs 4 image tokens"):
        mrope_positions(ids, torch.tensor([[1, 4, 4]]), image_token_id=5, merge_size=2)
    with pytest.raises(ValueError, match="2 image grid"):
        mrope_positions(torch.tensor([1, 5, 2]), torch.tensor([[1, 2, 2], [1, 2, 2]]), image_token_id=5, merge_size=2)


def test_mrope_table_of_text_positions_is_plain_rope():
    """With the same position on the three axes M-RoPE is 1-D RoPE: cos/sin of position x inv_freq."""
    table = MRoPE(head_dim=16, mrope_section=[2, 3, 3], base=10000.0)(torch.arange(6).expand(3, 1, -1))
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    expected = torch.arange(6).float()[:, None] * inv_freq
    assert torch.allclose(table[:, 0, 0], torch.cat([expected, expected], -1))


def test_round_trip_is_bitwise_and_logits_match_transformers(megatron_single_rank, tiny_vl):
    bridge = Bridge.from_hf_pretrained(tiny_vl)
    models = bridge.to_megatron_model(load_weights=True)
    original, exported = load_file(f"{tiny_vl}/model.safetensors"), export_all(bridge, models)
    assert sorted(exported) == sorted(original)
    assert any(name.startswith("visual.") for name in exported)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    batch = vision_batch(tiny_vl)
    _assert_rows_close(vision_pipeline_logits(models, bridge, batch), _reference_logits(tiny_vl, batch),
                       batch["lengths"])


def test_saved_checkpoint_loads_in_transformers(megatron_single_rank, tiny_vl, tmp_path):
    bridge = Bridge.from_hf_pretrained(tiny_vl)
    models = bridge.to_megatron_model(load_weights=True)
    bridge.save_hf_pretrained(models, tmp_path / "out")
    batch = vision_batch(tiny_vl)
    _assert_rows_close(_reference_logits(str(tmp_path / "out"), batch), _reference_logits(tiny_vl, batch),
                       batch["lengths"])


@pytest.mark.parametrize("family, tied", [("qwen2_5_vl", False), ("qwen2_vl", True)])
def test_tp2_pp2_round_trip_is_bitwise_and_logits_match_transformers(tmp_path, family, tied):
    hf = str(build_vision_quickstart_model(tmp_path / "hf", TEXTS, seed=5, family=family, tie_word_embeddings=tied))
    run_ranks("tests.bridge_worker:export_and_vision_logits", 4, [hf, str(tmp_path), "2", "2"], timeout_s=600)
    assert_every_rank_exported_the_checkpoint(hf, tmp_path, 4)
    batch = vision_batch(hf)
    expected = _reference_logits(hf, batch)
    for rank in (2, 3):
        _assert_rows_close(torch.load(tmp_path / f"logits_rank{rank}.pt"), expected, batch["lengths"])


def test_sequence_parallel_logits_match_transformers(tmp_path):
    hf = str(build_vision_quickstart_model(tmp_path / "hf", TEXTS, seed=6))
    batch = vision_batch(hf)
    run_ranks("tests.bridge_worker:export_and_vision_logits", 2, [hf, str(tmp_path), "2", "1", "1"], timeout_s=600)
    expected = _reference_logits(hf, batch)
    for rank in (0, 1):
        _assert_rows_close(torch.load(tmp_path / f"logits_rank{rank}.pt"), expected, batch["lengths"])


def test_context_parallelism_is_refused_with_a_clear_error(tmp_path):
    hf = str(build_vision_quickstart_model(tmp_path / "hf", TEXTS, seed=7))
    with pytest.raises(Exception, match="context parallelism"):
        run_ranks("tests.bridge_worker:build_with_context_parallel", 2, [hf], timeout_s=300)
