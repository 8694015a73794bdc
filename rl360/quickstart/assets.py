"""Build the quickstart's tokenizer and random-weight Qwen2 model (nothing is downloaded).

The tokenizer is word-level over the task's own text: ChatML special tokens, role names, digits, "+",
and one token per answer `\\boxed{N}`. Keeping the answer a single token keeps the exploration problem
small enough for a model trained from scratch by RL alone to solve it in a few minutes on a CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# One piece per: \boxed{N}, a digit, a word, any other single character.
PIECE_PATTERN = r"\\boxed\{[0-9]+\}|[0-9]|[A-Za-z]+|\s|."


ARITHMETIC_WORDS = ["user", "assistant", "system", "\n", " ", "+", "-", "=", "?", ".", "{", "}", "\\"]


def build_tokenizer(out_dir: str | Path, max_answer: int = 18, words: list[str] | None = None,
                    chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """The word-level tokenizer: the special tokens, `words` (the arithmetic task's by default; any string, each
    one token), the digits and `\\boxed{0}` ... `\\boxed{max_answer}`."""
    words = list(ARITHMETIC_WORDS if words is None else words)
    words += [str(d) for d in range(10)] + [f"\\boxed{{{n}}}" for n in range(max_answer + 1)]
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + words + ["<unk>"])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern=Regex(PIECE_PATTERN), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)
    # Every word is also an added token: transformers' AutoTokenizer rebuilds a Qwen2 model's
    # pre-tokenizer as byte-level BPE, and added tokens are matched before any pre-tokenizer runs.
    core.add_tokens([AddedToken(word, normalized=False, special=False) for word in words])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        chat_template=chat_template,
    )
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def build_model(out_dir: str | Path, vocab_size: int, eos_token_id: int, pad_token_id: int, seed: int = 0,
                hidden_size: int = 64, num_layers: int = 2, initializer_range: float = 0.1) -> None:
    """A tiny Qwen2 with random weights. A wide initialiser makes the untrained model's next-token
    distribution depend on the prompt, which RL needs to have something to reinforce."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=initializer_range,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )
    Qwen2ForCausalLM(config).save_pretrained(str(out_dir))


def build_quickstart_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Tokenizer and model together in one Hugging Face directory; returns it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    build_model(out_dir, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, seed=seed)
    (out_dir / "rl360_quickstart.json").write_text(json.dumps({"seed": seed}) + "\n")
    return out_dir
