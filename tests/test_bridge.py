"""megatron_bridge at TP=1 x PP=1: HF -> megatron -> HF round trip, logits parity, buckets, saving."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megatron_bridge import Bridge
from tests.helpers import make_tiny_qwen2


@pytest.fixture(params=[True, False], ids=["tied", "untied"])
def tiny(request, tmp_path):
    return make_tiny_qwen2(str(tmp_path / "hf"), tie_word_embeddings=request.param, seed=3)


def _exported(bridge, models, **kw):
    return {name: t for bucket in bridge.export_hf_weights(models, **kw) for name, t in bucket}


def test_round_trip_is_bitwise_identical(megatron_single_rank, tiny):
    bridge = Bridge.from_hf_pretrained(tiny)
    models = bridge.to_megatron_model(load_weights=True)
    original = load_file(f"{tiny}/model.safetensors")
    exported = _exported(bridge, models)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


def test_megatron_logits_match_transformers(megatron_single_rank, tiny):
    bridge = Bridge.from_hf_pretrained(tiny)
    model = bridge.to_megatron_model(load_weights=True)[0].eval()
    reference = AutoModelForCausalLM.from_pretrained(tiny).eval()
    lengths = [9, 5, 7]
    gen = torch.Generator().manual_seed(0)
    ids = torch.zeros(3, 9, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(1, 96, (n,), generator=gen)
    device = next(model.parameters()).device
    with torch.no_grad():
        ours = model(ids.to(device), torch.arange(9, device=device).expand(3, 9), None).cpu()
        for row, n in enumerate(lengths):
            theirs = reference(ids[row:row + 1, :n]).logits[0]
            assert (ours[row, :n] - theirs).abs().max().item() <= 1e-4


def test_buckets_are_bounded_and_cover_every_tensor_once(megatron_single_rank, tiny):
    bridge = Bridge.from_hf_pretrained(tiny)
    models = bridge.to_megatron_model(load_weights=True)
    limit = 40_000
    names = []
    for bucket in bridge.export_hf_weights(models, bucket_bytes=limit):
        sizes = [t.numel() * t.element_size() for _, t in bucket]
        assert sum(sizes) <= limit or len(bucket) == 1
        names += [name for name, _ in bucket]
    assert len(names) == len(set(names)) == len(load_file(f"{tiny}/model.safetensors"))


def test_saved_checkpoint_loads_and_gives_same_logits(megatron_single_rank, tiny, tmp_path):
    bridge = Bridge.from_hf_pretrained(tiny)
    models = bridge.to_megatron_model(load_weights=True)
    with torch.no_grad():  # change the weights so the test cannot pass by copying the input
        for p in models[0].parameters():
            p.mul_(1.01)
    bridge.save_hf_pretrained(models, tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    device = next(models[0].parameters()).device
    with torch.no_grad():
        ours = models[0].eval()(ids.to(device), torch.arange(6, device=device).expand(2, 6), None).cpu()
        assert (loaded(ids).logits - ours).abs().max().item() <= 1e-4


def test_unsupported_field_is_named(tmp_path):
    path = make_tiny_qwen2(str(tmp_path / "hf"), tie_word_embeddings=True)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        Bridge.from_hf_pretrained(path)
    config["architectures"] = ["MambaForCausalLM"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MambaForCausalLM"):
        Bridge.from_hf_pretrained(path)
