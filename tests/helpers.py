"""Small shared helpers for the tests."""

from __future__ import annotations

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
