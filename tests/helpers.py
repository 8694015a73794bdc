"""Small shared helpers for the tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def make_tiny_qwen2(out_dir: str, tie_word_embeddings: bool, seed: int = 0, vocab_size: int = 96,
                    num_layers: int = 2, rope_theta: float = 10000.0) -> str:
    """Save a random tiny Qwen2 (GQA: 4 heads, 2 key/value groups) to `out_dir` and return it."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=tie_word_embeddings,
                         initializer_range=0.1, rope_theta=rope_theta)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # non-trivial norm weights and biases, so a layout slip cannot hide
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(out_dir)
    return out_dir


def make_tiny_model(out_dir: str, arch: str, tie_word_embeddings: bool, seed: int = 0, vocab_size: int = 99,
                    num_layers: int = 4, hidden_size: int = 64, intermediate_size: int = 128) -> str:
    """Save a random tiny `arch` ("qwen2", "qwen3" or "llama") with GQA (4 heads, 2 key/value groups) and a
    vocabulary that does not split evenly (so the bridge's padding is exercised); return `out_dir`.

    Qwen3 gets a head_dim different from hidden/heads, Llama the llama3 RoPE scaling of Llama 3.1. The
    mixtures of experts ("qwen3_moe", "qwen2_moe") have 4 experts of width 32, top-2 routing: Qwen3-MoE's
    renormalised over the two (norm_topk_prob, as Qwen3-30B-A3B), Qwen2-MoE's not (as Qwen1.5-MoE-A2.7B),
    beside its gated shared expert of width 48."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, tie_word_embeddings=tie_word_embeddings, initializer_range=0.1)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=1_000_000.0))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32, rope_theta=1_000_000.0))
    elif arch == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, head_dim=32, rope_theta=1_000_000.0, num_experts=4,
                                                   num_experts_per_tok=2, moe_intermediate_size=32,
                                                   norm_topk_prob=True))
    elif arch == "qwen2_moe":
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**common, rope_theta=1_000_000.0, num_experts=4,
                                                   num_experts_per_tok=2, moe_intermediate_size=32,
                                                   shared_expert_intermediate_size=48, norm_topk_prob=False))
    elif arch == "llama":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_theta": 10000.0}
        common["max_position_embeddings"] = 16384  # above the scaling's original 8192, as in Llama 3.1
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0, rope_scaling=rope))
    else:
        raise ValueError(f"unknown arch {arch!r}")
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(0.1 * torch.randn_like(param) + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(out_dir)
    return out_dir


def sglang_wheel(version: str) -> Path:
    """SGLang's release wheel `version` (metadata and sources only: it is not installed), from
    ~/.cache/rl360/sglang, downloaded there if absent; skips the test when there is no network."""
    cache = Path.home() / ".cache" / "rl360" / "sglang"
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if not wheels:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64",
                               f"sglang=={version}", "-d", str(cache)], capture_output=True, text=True)
        wheels = sorted(cache.glob(f"sglang-{version}-*.whl"))
        if not wheels:
            network = ("Network is unreachable", "Temporary failure in name resolution", "ConnectionError",
                       "Max retries exceeded", "No route to host")
            if any(sign in done.stdout + done.stderr for sign in network):
                pytest.skip(f"cannot download sglang=={version}: no network")
            raise AssertionError(f"pip download sglang=={version} failed:\n{done.stdout}\n{done.stderr}")
    return wheels[0]


def png_bytes(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    """A PNG of one colour, compressed as an `images` cell holds it."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


def assert_every_rank_exported_the_checkpoint(hf_dir: str, out_dir, ranks: int) -> dict:
    """Each rank's `exported_rank<r>.safetensors` (tests.bridge_worker) holds every tensor of `hf_dir`'s checkpoint,
    bit for bit; returns the checkpoint."""
    from safetensors.torch import load_file

    original = load_file(f"{hf_dir}/model.safetensors")
    for rank in range(ranks):
        exported = load_file(f"{out_dir}/exported_rank{rank}.safetensors")
        assert sorted(exported) == sorted(original), rank
        for name, tensor in original.items():
            assert torch.equal(exported[name], tensor), (rank, name)
    return original
