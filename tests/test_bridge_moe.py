"""megatron_bridge for mixtures of experts (Qwen3-MoE, Qwen2-MoE with its gated shared expert): bitwise round
trips and logits parity with transformers at 1 rank, TP=2, EP=2, TP=2 x EP=2 and EP=2 x PP=2 (gloo
processes); saved checkpoints load in transformers; config fields the bridge cannot honour are refused."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megatron_bridge import Bridge
from megatron_bridge.config_map import check_supported, to_hf_config, to_megatron
from rl360.plan import rank_parameters
from tests.bridge_worker import export_all, token_ids
from tests.helpers import make_tiny_model
from tests.rank_cases import launch_by_world, output

ARCHS = ["qwen3_moe", "qwen2_moe"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Each architecture once per module: 4 experts, top-2, 2 layers of hidden 64."""
    root = tmp_path_factory.mktemp("moe")
    return {arch: make_tiny_model(str(root / arch), arch, tie_word_embeddings=False, seed=11 + k, num_layers=2)
            for k, arch in enumerate(ARCHS)}


def _transformers_logits(hf: str) -> torch.Tensor:
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(hf).eval()(token_ids()).logits


def _assert_bitwise(exported: dict[str, torch.Tensor], original: dict[str, torch.Tensor], where) -> None:
    assert sorted(exported) == sorted(original), where
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), (where, name)


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_on_disk_has_one_tensor_per_expert(tiny, arch):
    """The per-expert names released checkpoints use (transformers 5 fuses experts only in memory)."""
    names = set(load_file(f"{tiny[arch]}/model.safetensors"))
    for e in range(4):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.1.mlp.experts.{e}.{proj}.weight" in names
    assert ("model.layers.0.mlp.shared_expert_gate.weight" in names) == (arch == "qwen2_moe")


@pytest.mark.parametrize("arch", ARCHS)
def test_one_rank_round_trip_logits_and_saved_checkpoint(megatron_single_rank, tiny, tmp_path, arch):
    from tests.bridge_worker import pipeline_logits

    hf = tiny[arch]
    bridge = Bridge.from_hf_pretrained(hf)
    models = bridge.to_megatron_model(load_weights=True)
    config = models[0].config
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (4, 2, 32)
    # Qwen3-MoE renormalises over the top 2 (megatron: softmax over the 2), Qwen2-MoE does not (softmax first)
    assert config.moe_router_pre_softmax == (arch == "qwen2_moe")
    assert config.moe_router_load_balancing_type == "none" and config.moe_aux_loss_coeff == 0.0
    original = load_file(f"{hf}/model.safetensors")
    _assert_bitwise(export_all(bridge, models), original, "rank 0")
    logits = pipeline_logits(models, token_ids(), bridge.vocab_size)
    assert (logits - _transformers_logits(hf)).abs().max().item() <= 1e-4
    bridge.save_hf_pretrained(models, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == _config(tiny, arch)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    reference = AutoModelForCausalLM.from_pretrained(hf).eval()
    for (name, theirs), (_, ours) in zip(reference.state_dict().items(), saved.state_dict().items(), strict=True):
        assert torch.equal(theirs, ours), name


LAYOUTS = [  # (arch, ranks, TP, PP, EP)
    ("qwen3_moe", 2, 2, 1, 1),
    ("qwen2_moe", 2, 2, 1, 1),
    ("qwen3_moe", 2, 1, 1, 2),
    ("qwen2_moe", 2, 1, 1, 2),
    ("qwen2_moe", 4, 2, 1, 2),
    ("qwen3_moe", 4, 1, 2, 2),
]


@pytest.fixture(scope="module")
def launched(tiny, tmp_path_factory):
    """Every layout of LAYOUTS loaded by `tests.bridge_worker:export_and_logits_case`, one launch of the ranks per
    world size (`tests.rank_cases`); at EP > 1 the ranks also save the model."""
    cases = {layout: (layout[1], [tiny[layout[0]], *map(str, layout[2:]), "1" if layout[4] > 1 else "0"])
             for layout in LAYOUTS}
    return launch_by_world("tests.bridge_worker:export_and_logits_case", cases, tmp_path_factory.mktemp("moe_ranks"))


@pytest.mark.parametrize("arch, ranks, tp, pp, ep", LAYOUTS,
                         ids=[f"{a}-tp{t}pp{p}ep{e}" for a, _, t, p, e in LAYOUTS])
def test_parallel_round_trip_is_bitwise_and_logits_match_transformers(tiny, launched, arch, ranks, tp, pp, ep):
    """Every rank loads only its experts (EP) and slices (TP), and yields the whole HF model, identical to the
    input; the last stage's logits match transformers'. At EP > 1 rank r holds experts 2r, 2r+1 as its local
    0, 1: a misplaced expert would route tokens to the wrong weights and show in the logits."""
    hf = tiny[arch]
    tmp_path = output(launched, (arch, ranks, tp, pp, ep))
    original = load_file(f"{hf}/model.safetensors")
    for rank in range(ranks):
        _assert_bitwise(load_file(tmp_path / f"exported_rank{rank}.safetensors"), original, rank)
    hf_config = _config(tiny, arch)
    for rank in range(ranks):  # `rl360 plan`'s count of each rank's share: megatron's own tensors
        held = int((tmp_path / f"parameters_rank{rank}.txt").read_text())
        assert rank_parameters(hf_config, tp, pp, stage=rank // (ranks // pp), expert=ep) == held, rank
    expected = _transformers_logits(hf)
    last_stage = range(ranks - ranks // pp, ranks)
    for rank in last_stage:
        logits = torch.load(tmp_path / f"logits_rank{rank}.pt")
        assert (logits - expected).abs().max().item() <= 1e-4, rank
    if ep > 1:  # saved from EP-sharded experts, in shards: transformers loads it, the same weights
        saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
        reference = AutoModelForCausalLM.from_pretrained(hf).eval()
        for (name, theirs), (_, ours) in zip(reference.state_dict().items(), saved.state_dict().items(),
                                             strict=True):
            assert torch.equal(theirs, ours), name


def test_experts_that_do_not_split_over_ep_are_refused(tiny):
    from megatron_bridge.arch import get_architecture

    config = _config(tiny, "qwen3_moe")
    with pytest.raises(ValueError, match="num_experts=4 is not divisible by EP=8"):
        to_megatron(config, get_architecture(config), expert_parallel=8)
    with pytest.raises(ValueError, match="moe_intermediate_size=32 is not divisible by TP=3"):
        to_megatron(config | {"num_attention_heads": 6, "num_key_value_heads": 3}, get_architecture(config),
                    tensor_parallel=3)


def _config(tiny, arch: str) -> dict:
    return json.loads(Path(tiny[arch], "config.json").read_text())


@pytest.mark.parametrize("field, value, message", [
    ("decoder_sparse_step", 2, "decoder_sparse_step=2"),
    ("mlp_only_layers", [1], "mlp_only_layers=[1]"),
    ("num_experts_per_tok", 5, "num_experts_per_tok=5"),
])
def test_layers_or_routing_the_bridge_cannot_build_are_refused(tiny, field, value, message):
    config = _config(tiny, "qwen2_moe") | {field: value}
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_supported(config)


def test_top1_with_renormalisation_is_refused(tiny):
    config = _config(tiny, "qwen3_moe") | {"num_experts_per_tok": 1, "norm_topk_prob": True}
    with pytest.raises(ValueError, match="norm_topk_prob=True with num_experts_per_tok=1"):
        check_supported(config)


def test_saved_config_is_checked_against_the_moe_model(megatron_single_rank, tiny):
    bridge = Bridge.from_hf_pretrained(tiny["qwen3_moe"])
    model = bridge.to_megatron_model(load_weights=False)[0]
    assert to_hf_config(bridge.hf_config, model, torch.float32) == bridge.hf_config
    for field, value in [("moe_intermediate_size", 64), ("num_experts_per_tok", 3), ("norm_topk_prob", False)]:
        with pytest.raises(ValueError, match=field):
            to_hf_config(bridge.hf_config | {field: value}, model, torch.float32)


def test_aux_loss_is_off_unless_configured(tiny):
    from megatron_bridge.arch import get_architecture

    config = _config(tiny, "qwen2_moe")
    arch = get_architecture(config)
    assert config["router_aux_loss_coef"] > 0  # config.json's coefficient is not taken ...
    off, _ = to_megatron(config, arch)
    assert (off.moe_router_load_balancing_type, off.moe_aux_loss_coeff) == ("none", 0.0)
    on, _ = to_megatron(config, arch, training={"moe_aux_loss_coeff": 0.01})  # ... the run's is
    assert (on.moe_router_load_balancing_type, on.moe_aux_loss_coeff) == ("aux_loss", 0.01)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_other_routing_would_show_in_the_logits(megatron_single_rank, tiny, arch):
    """norm_topk_prob flipped (megatron's other routing) moves the logits far past the 1e-4 the tests allow."""
    from tests.bridge_worker import pipeline_logits

    config = _config(tiny, arch)
    bridge = Bridge(tiny[arch], config | {"norm_topk_prob": not config["norm_topk_prob"]})
    logits = pipeline_logits(bridge.to_megatron_model(load_weights=True), token_ids(), bridge.vocab_size)
    assert (logits - _transformers_logits(tiny[arch])).abs().max().item() > 0.1
