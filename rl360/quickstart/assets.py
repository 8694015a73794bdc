"""Build the quickstart's tokenizer and random-weight Qwen2 model (nothing is downloaded).

The tokenizer is word-level over the task's own text: ChatML special tokens, role names, digits, "+",
and one token per answer `\\boxed{N}`. Keeping the answer a single token keeps the exploration problem
small enough for a model trained from scratch by RL alone to solve it in a few minutes on a CPU.
"""

from __future__ import annotations

import json
import math
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


def raise_token_prior(embedding: torch.Tensor, index: int, logits: torch.Tensor, hidden: torch.Tensor,
                      probability: float, keep: torch.Tensor | None = None) -> None:
    """Raise, in place, the probability of token `index` at a position with `logits` and final (normed) hidden
    state `hidden` to `probability`, by adding to the token's row of the tied `embedding` that hidden state's
    direction (less its part along `keep`, a hidden state where the token's logit is to stay as it is); the other
    tokens' logits do not change."""
    others = torch.cat([logits[:index], logits[index + 1:]]).logsumexp(-1).item()
    target = others + math.log(probability / (1 - probability))
    direction = hidden
    if keep is not None:
        direction = hidden - hidden.dot(keep) / keep.dot(keep) * keep
    with torch.no_grad():
        embedding[index] += ((target - logits[index].item()) * direction / direction.dot(hidden)).to(embedding.dtype)


def next_token_states(model_dir: str | Path, conversations: list[list[dict]]):
    """The saved text model and tokenizer, and at the position after each of `conversations` (chat messages,
    rendered with the generation prompt) its logits and final hidden states (one row per conversation)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = Qwen2ForCausalLM.from_pretrained(str(model_dir))
    logits, hidden = [], []
    with torch.no_grad():
        for messages in conversations:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"]
            out = model(input_ids=ids, output_hidden_states=True)
            logits.append(out.logits[0, -1].double())
            hidden.append(out.hidden_states[-1][0, -1].double())  # the last: after the final norm
    return model, tokenizer, torch.stack(logits), torch.stack(hidden)


def next_token_probabilities(model_dir: str | Path, token: str, conversations: list[list[dict]]) -> list[float]:
    """The saved text model's probability of writing `token` next after each of `conversations`."""
    _, tokenizer, logits, _ = next_token_states(model_dir, conversations)
    return logits.softmax(-1)[:, tokenizer.convert_tokens_to_ids(token)].tolist()


def prime_first_token(model_dir: str | Path, token: str, conversations: list[list[dict]], probability: float,
                      keep: list[list[dict]] | None = None) -> None:
    """Raise the saved text model's probability of writing `token` next after `conversations` to about
    `probability` (`raise_token_prior` at their mean logits and hidden state), leaving it about as it is after
    the `keep` conversations (at their mean hidden state): a prior like an instruct model's habit of calling its
    tools first, the same whatever the prompt asks, so it tells nothing about the answer."""
    model, tokenizer, logits, hidden = next_token_states(model_dir, conversations)
    if not model.config.tie_word_embeddings:
        raise ValueError("prime_first_token: the model's input and output embeddings must be tied")
    kept = next_token_states(model_dir, keep)[3].mean(0) if keep else None
    raise_token_prior(model.get_input_embeddings().weight, tokenizer.convert_tokens_to_ids(token), logits.mean(0),
                      hidden.mean(0), probability, kept)
    model.save_pretrained(str(model_dir))


def build_quickstart_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Tokenizer and model together in one Hugging Face directory; returns it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    build_model(out_dir, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, seed=seed)
    (out_dir / "rl360_quickstart.json").write_text(json.dumps({"seed": seed}) + "\n")
    return out_dir
