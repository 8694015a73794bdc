"""megatron_bridge at TP=2 x PP=2 on CPU (4 gloo processes): round trip, logits parity, checkpoints at
other layouts through `rl360 convert`, and per-rank memory while loading. The round trips of one world size run
in one launch of their ranks (`launched`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megatron_bridge import Bridge
from rl360.cluster.launch import RankFailed, run_ranks
from tests.bridge_worker import token_ids
from tests.helpers import assert_every_rank_exported_the_checkpoint, make_tiny_model
from tests.rank_cases import launch_by_world, output

ARCHS = ["qwen2", "qwen3", "llama"]


TIED = [True, False]
VPP_SEED = 3


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every tiny model loaded by `tests.bridge_worker:export_and_logits_case` at its layout, one launch of the ranks
    per world size: TP=2 x PP=2 for each architecture, tied or not (4 ranks); PP=2 x VPP=2, tied or not (2 ranks).
    (layout, arch, tied) -> (the HF directory, the case's output directory or its launch's `RankFailed`)."""
    root = tmp_path_factory.mktemp("bridge_parallel")
    cases = [(("tp2pp2", arch, tied), ARCHS.index(arch), 4, ["2", "2"]) for arch in ARCHS for tied in TIED]
    cases += [(("vpp2", "qwen3", tied), VPP_SEED, 2, ["1", "2", "1", "0", "2"]) for tied in TIED]
    models = {key: make_tiny_model(str(root / f"hf{number}"), key[1], tie_word_embeddings=key[2], seed=seed)
              for number, (key, seed, _, _) in enumerate(cases)}
    outputs = launch_by_world("tests.bridge_worker:export_and_logits_case",
                              {key: (world, [models[key], *layout]) for key, _, world, layout in cases}, root)
    return {key: (models[key], outputs[key]) for key in models}


def _case(launched: dict, key: tuple) -> tuple[str, Path]:
    hf, _ = launched[key]
    return hf, output({key: launched[key][1]}, key)


@pytest.mark.parametrize("tied", TIED, ids=["tied", "untied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_pp2_round_trip_is_bitwise_and_logits_match_transformers(launched, arch, tied):
    hf, out = _case(launched, ("tp2pp2", arch, tied))
    original = assert_every_rank_exported_the_checkpoint(hf, out, 4)  # the whole model, on every rank
    assert ("lm_head.weight" in original) != tied
    reference = AutoModelForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        expected = reference(token_ids()).logits
    for rank in (2, 3):  # the last pipeline stage's two tensor-parallel ranks
        logits = torch.load(out / f"logits_rank{rank}.pt")
        assert logits.shape == expected.shape
        assert (logits - expected).abs().max().item() <= 1e-4, rank


@pytest.mark.parametrize("tied", TIED, ids=["tied", "untied"])
def test_virtual_pipeline_chunks_round_trip_bitwise_and_match_transformers(launched, tied):
    """PP=2 x VPP=2: each rank holds two non-adjacent layer chunks (rank 0: layers 0 and 2, rank 1: 1 and 3;
    the embedding in rank 0's first chunk, the output layer in rank 1's last) and the interleaved schedule runs
    them."""
    hf, out = _case(launched, ("vpp2", "qwen3", tied))
    assert_every_rank_exported_the_checkpoint(hf, out, 2)
    reference = AutoModelForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        expected = reference(token_ids()).logits
    assert not (out / "logits_rank0.pt").exists()
    logits = torch.load(out / "logits_rank1.pt")
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() <= 1e-4


def _convert(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "rl360.cli", "convert", *args], check=True, timeout=600)


@pytest.mark.parametrize("save_at, load_at, arch, tied", [
    ((2, 2), (1, 1), "qwen3", True),
    ((1, 1), (2, 2), "llama", False),
], ids=["tp2pp2-to-tp1pp1", "tp1pp1-to-tp2pp2"])
def test_checkpoint_saved_at_one_layout_loads_at_another(tmp_path, save_at, load_at, arch, tied):
    hf = make_tiny_model(str(tmp_path / "hf"), arch, tie_word_embeddings=tied)
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    _convert("hf-to-megatron", "--hf", hf, "--out", str(ckpt), "--tp", str(save_at[0]), "--pp", str(save_at[1]))
    meta = json.loads((ckpt / "rl360.json").read_text())
    assert (meta["tensor_parallel"], meta["pipeline_parallel"], meta["dtype"]) == (*save_at, "float32")
    _convert("megatron-to-hf", "--ckpt", str(ckpt), "--out", str(back), "--tp", str(load_at[0]),
             "--pp", str(load_at[1]))
    original, converted = load_file(f"{hf}/model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(converted) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor), name
    config = json.loads((back / "config.json").read_text())
    assert config == json.loads((tmp_path / "hf" / "config.json").read_text())
    AutoModelForCausalLM.from_pretrained(back)  # and transformers takes it


def test_convert_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rl360.cli", "convert", "megatron-to-hf", "--ckpt", str(tmp_path),
                           "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "rl360.json not found" in proc.stderr


def test_a_failing_rank_is_reported_with_its_output(tmp_path):
    hf = make_tiny_model(str(tmp_path / "hf"), "qwen2", tie_word_embeddings=False)  # 4 heads: TP=3 cannot split
    with pytest.raises(RankFailed, match="num_attention_heads=4 is not divisible by TP=3"):
        run_ranks("rl360.convert:hf_to_megatron_rank", 3, [hf, str(tmp_path / "ckpt"), "3", "1", "float32"],
                  timeout_s=600)


def test_loading_peak_memory_per_rank_is_its_share_plus_about_one_tensor(tmp_path):
    """A 268 MB model (16 layers of hidden 512 / ffn 2048) at TP=2 x PP=2: each rank holds ~67 MB; the memory
    its loading adds at peak stays below one tensor, far below the whole checkpoint, which a whole-file read
    does add."""
    from benchmarks.bridge_load_memory import make_model, run

    hf = make_model(str(tmp_path / "hf"), layers=16)
    checkpoint_bytes = (tmp_path / "hf" / "model.safetensors").stat().st_size
    largest = max(t.numel() * t.element_size() for t in load_file(f"{hf}/model.safetensors").values())
    for report in run(hf, str(tmp_path), 2, 2):
        assert report["share_bytes"] < 0.3 * checkpoint_bytes
        # reads land in their parameters' own memory: less than one tensor of transient memory (about 1 MiB)
        assert report["load_peak_bytes"] <= largest + (16 << 20), report
        assert report["load_peak_bytes"] < 0.15 * checkpoint_bytes, report
        assert report["whole_read_peak_bytes"] > 0.9 * checkpoint_bytes, report  # the measure sees a whole read


def test_llama3_rope_scaling_reaches_megatron(megatron_single_rank, tmp_path):
    hf = make_tiny_model(str(tmp_path / "hf"), "llama", tie_word_embeddings=False)
    model = Bridge.from_hf_pretrained(hf).to_megatron_model(load_weights=False)[0]
    reference = AutoModelForCausalLM.from_pretrained(hf)
    theirs = reference.model.rotary_emb.inv_freq
    plain = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert not torch.allclose(theirs, plain)  # the scaling changes some frequencies ...
    torch.testing.assert_close(model.rotary_pos_emb.inv_freq.cpu(), theirs, rtol=1e-6, atol=0)  # ... and ours
