"""Small shared helpers for the tests.

A bf16 comparison is exact (torch.equal) only where both sides run the same ops in the same order on the same
shapes (offloaded vs resident, resumed vs unbroken); where they may run different kernels, shapes or reduction
orders it is bounded by bf16 resolution with `assert_close_bf16`, and tests/test_bf16_kernels.py reruns those
comparisons with oneDNN's AVX-512/AMX bf16 kernels forced off."""

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


BF16_EPS = 2.0 ** -8  # bf16's unit roundoff: 8 significant bits


def assert_close_bf16(actual: torch.Tensor, expected: torch.Tensor, *, steps: int, mask: torch.Tensor | None = None,
                      mean: bool = False, what: str = "") -> None:
    """`actual` is within bf16 resolution of `expected`, for two bf16 computations that may round differently
    (other kernels, as oneDNN's per-ISA ones, shapes or reduction orders, or bf16 against fp32).

    bf16 keeps 8 significant bits: a value of magnitude m is stored to within m * eps (eps = 2**-8), and two
    computations of it that round differently land up to one ulp, 2 * m * eps, apart. Each of `steps` optimizer
    steps starts from weights that may already differ so and can flip one more rounding (Adam moves every weight
    by about lr whatever its gradient's scale, so a slightly different gradient still shifts it by a fraction of lr),
    so each element may be (1 + steps) ulps apart, m being its own magnitude but at least the root-mean-square of
    `expected` (a weight near zero is moved on the tensor's scale, not its own).

    mean=True bounds the mean absolute difference over `mask` instead, by (1 + steps) * eps times the mean
    magnitude (half an ulp a step): for outputs such as log-probs, where a few near-tied tokens may swing far
    while the bulk cannot."""
    actual, expected = actual.detach().double(), expected.detach().double()
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    weight = torch.ones_like(expected) if mask is None else mask.double().expand_as(expected)
    diff, size = (actual - expected).abs() * weight, expected.abs() * weight
    if mean:
        got, bound = diff.sum() / weight.sum(), (1 + steps) * BF16_EPS * size.sum() / weight.sum()
        assert got <= bound, f"{what}: mean |difference| {got:.3g} over bf16's {1 + steps} half-ulps {bound:.3g}"
        return
    rms = (size.pow(2).sum() / weight.sum()).sqrt()
    ulps = diff / (2 * BF16_EPS * torch.maximum(size, rms))
    worst = int(ulps.argmax())
    assert ulps.max() <= 1 + steps, (f"{what}: element {worst} {actual.flatten()[worst].item():.6g} vs "
                                     f"{expected.flatten()[worst].item():.6g} is {ulps.max():.1f} bf16 ulps apart "
                                     f"(bound {1 + steps}); {int((diff > 0).sum())} of {diff.numel()} differ")


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


def serving_url(proc) -> str:
    """The URL an `rl360 serve ...` process (stdout piped, text) prints in its "serving ... on URL" line, read
    line by line until it appears; fails with everything it printed when it exits first."""
    seen = []
    while not seen or "serving" not in seen[-1]:
        seen.append(proc.stdout.readline())
        assert seen[-1], "".join(seen)  # the server exited before serving
    return seen[-1].split(" on ", 1)[1].split()[0]
