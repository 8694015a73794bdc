"""LoRA on the Megatron policy (megatron_bridge/lora.py): one TP=2 run (tests/lora_worker.py) serves the checks of
gradients, merged export, adapters-only checkpoints and exact resume; the checkpoint then converts to a PEFT adapter
that `peft` loads over the base model and that reproduces the policy's logits (reloaded at TP=1)."""

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from megatron_bridge.lora import TARGETS
from rl360.cluster.launch import run_ranks
from rl360.config import ConfigError, load_config
from rl360.plan import lora_rank_parameters, plan
from tests.helpers import make_tiny_qwen2
from tests.lora_worker import ALPHA, RANK, lora_config

SCALE = ALPHA / RANK


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    model_dir = make_tiny_qwen2(str(out / "base"), tie_word_embeddings=True, seed=5)
    run_ranks("tests.lora_worker:main", 2, [model_dir, str(out)], timeout_s=900)
    return out, model_dir


def pairs(adapters: dict) -> list[tuple[str, str, str]]:
    """(HF weight name, lora_A name, lora_B name) of every adapted projection."""
    return [(name.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight", name,
             name.replace(".lora_A.", ".lora_B.")) for name in adapters if ".lora_A." in name]


def test_adapters_cover_every_targeted_projection(run):
    out, _ = run
    adapters = load_file(out / "adapters.safetensors")
    names = {weight.split(".")[-2] for weight, _, _ in pairs(adapters)}
    assert names == set(TARGETS) and len(pairs(adapters)) == 2 * len(TARGETS)  # 2 layers
    counts = json.loads((out / "trainable.json").read_text())
    config = json.loads((out / "base" / "config.json").read_text())
    assert counts["parameters"] == lora_rank_parameters(config, RANK, TARGETS, tensor=2)  # the plan counts the same
    assert counts["tensors"] == 2 * 2 * len(TARGETS) and counts["frozen"] > 5 * counts["parameters"]


def test_lora_gradients_are_the_full_gradients_projected(run):
    """dL/dB = scale dL/dW A^T and dL/dA = scale B^T dL/dW, dL/dW the whole model's gradient at W + scale B A."""
    out, _ = run
    adapters = load_file(out / "adapters.safetensors")
    lora, full = load_file(out / "lora_gradient.safetensors"), load_file(out / "full_gradient.safetensors")
    for weight, a_name, b_name in pairs(adapters):
        a, b, grad_w = adapters[a_name], adapters[b_name], full[weight]
        assert b.abs().max() > 0 and grad_w.abs().max() > 1e-3, weight
        torch.testing.assert_close(lora[a_name], SCALE * b.T @ grad_w, atol=2e-6, rtol=1e-4, msg=weight)
        torch.testing.assert_close(lora[b_name], SCALE * grad_w @ a.T, atol=2e-6, rtol=1e-4, msg=weight)


def test_merged_export_is_base_plus_scaled_ba_bit_for_bit(run):
    out, model_dir = run
    adapters, merged = load_file(out / "adapters.safetensors"), load_file(out / "merged.safetensors")
    base = load_file(f"{model_dir}/model.safetensors")
    adapted = {weight: (a, b) for weight, a, b in pairs(adapters)}
    assert sorted(merged) == sorted(base)
    for name, weight in base.items():
        if name in adapted:
            a, b = adapters[adapted[name][0]], adapters[adapted[name][1]]
            expected = weight + SCALE * (b @ a)
            assert not torch.equal(expected, weight), name
        else:
            expected = weight
        assert torch.equal(merged[name], expected), name


def test_checkpoint_holds_only_adapters_and_resumes_exactly(run):
    from megatron.core import dist_checkpointing

    out, _ = run
    keys = dist_checkpointing.load_tensors_metadata(str(out / "ckpt"))
    model_keys = [key for key in keys if not key.startswith("optimizer.")]
    assert model_keys and all(".lora_" in key for key in model_keys), model_keys
    assert any(key.startswith("optimizer.") for key in keys)
    saved, loaded = load_file(out / "saved.safetensors"), load_file(out / "loaded.safetensors")
    unbroken, resumed = load_file(out / "unbroken.safetensors"), load_file(out / "resumed.safetensors")
    for name in saved:
        assert torch.equal(loaded[name], saved[name]), name
        assert torch.equal(resumed[name], unbroken[name]), name
    assert max((unbroken[name] - saved[name]).abs().max().item() for name in saved) > 1e-4  # the step moved them


def test_peft_loads_the_converted_adapter_and_reproduces_the_policy(run, megatron_single_rank, tmp_path):
    """The TP=2 checkpoint, converted by `rl360 convert lora-to-peft` and loaded by PEFT over the base model, gives
    the logits of the policy that loads the same checkpoint at TP=1."""
    import subprocess

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rl360.actor.policy import PolicyWorker
    from rl360.actor.settings import PolicySettings

    out, model_dir = run
    adapter_dir = tmp_path / "peft"
    subprocess.run([sys.executable, "-m", "rl360.cli", "convert", "lora-to-peft", "--ckpt", str(out / "ckpt"),
                    "--out", str(adapter_dir)], check=True, timeout=600)
    policy = PolicyWorker(PolicySettings.of(lora_config(model_dir, 1)))
    policy.load_checkpoint(str(out / "ckpt"))
    input_ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(1))
    ours = policy.logits(input_ids)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(input_ids).logits
        peft_logits = PeftModel.from_pretrained(base, str(adapter_dir)).eval()(input_ids).logits
    assert (ours - base_logits).abs().max() > 1e-2  # the adapters change the model
    torch.testing.assert_close(peft_logits, ours, atol=1e-5, rtol=0)


def test_plan_counts_lora_optimizer_state_under_five_percent_at_rank_64():
    def optimizer_gib(rank: int) -> float:
        cfg = load_config("configs/quickstart.yaml", ["model.path=Qwen/Qwen2.5-1.5B-Instruct", "model.dtype=bfloat16",
                                                      f"actor.lora.rank={rank}"])
        return next(term.bytes for term in plan(cfg).terms if term.name.startswith("policy optimizer"))

    assert optimizer_gib(64) <= 0.05 * optimizer_gib(0)


@pytest.mark.parametrize("override, message", [
    ("actor.lora.targets=[q_proj,qproj]", "unknown LoRA targets ['qproj']"),
    ("actor.lora.rank=-1", "actor.lora.rank=-1 must be >= 0"),
    ("model.attention=te", "use model.attention=auto or torch"),
])
def test_lora_config_mistakes(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config("configs/quickstart.yaml", ["actor.lora.rank=8", override])
