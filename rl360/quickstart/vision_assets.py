"""Build a tiny Qwen2.5-VL model directory locally (nothing is downloaded): config, random weights, tokenizer,
image processor and chat template, laid out as a Hugging Face checkpoint of Qwen2.5-VL is.

The tokenizer is word-level like the text quickstart's (`rl360.quickstart.assets`): ChatML and vision special
tokens, role names, digits, punctuation, one token per answer `\\boxed{N}`, the words of the default system
prompt, every word of the `texts` it is built for and each of `added_tokens` whole (e.g. a tool call the model
writes as one token). The model: vision tower of hidden size 32 and depth 2,
language model of hidden size 64 with 2 layers and grouped-query attention (4 query heads, 2 key/value heads of
dimension 16, multimodal rotary sections 2 + 3 + 3 = 16 / 2). Patches of 14 pixels merged 2 x 2, and images
bounded to 28 x 28 ... 112 x 112 pixels of area, so a 56 x 56 image is 4 image tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rl360.quickstart.assets import PIECE_PATTERN, SPECIAL_TOKENS, raise_token_prior

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
DEFAULT_SYSTEM = "You are a helpful assistant."
# Qwen2-VL's chat template, written for this tokenizer: a default system message, images as
# <|vision_start|><|image_pad|><|vision_end|> in place within a message's content list.
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' or 'video' in part %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 28 * 28, 112 * 112  # 1 to 16 image tokens per image


def words_of(texts: Iterable[str]) -> list[str]:
    """The distinct pieces (words, digits, single characters) of `texts`, as the tokenizer splits them, in order."""
    seen: dict[str, None] = {}
    for text in texts:
        for piece in re.findall(PIECE_PATTERN, text):
            seen.setdefault(piece)
    return list(seen)


def build_vision_tokenizer(out_dir: str | Path, texts: Iterable[str] = (), max_answer: int = 18,
                           added_tokens: Iterable[str] = ()) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with ChatML and vision special tokens that spells `texts` without `<unk>`, and
    each of `added_tokens` as one token."""
    words = ["user", "assistant", "system", "\n", " ", "+", "-", "=", "?", ".", ",", ":", "{", "}", "\\"]
    words += [str(d) for d in range(10)] + [f"\\boxed{{{n}}}" for n in range(max_answer + 1)]
    words += [word for word in words_of([DEFAULT_SYSTEM, *texts]) if word not in words]
    words += [token for token in dict.fromkeys(added_tokens) if token not in words]
    specials = SPECIAL_TOKENS + VISION_TOKENS
    vocab = {token: i for i, token in enumerate(specials + words + ["<unk>"])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern=Regex(PIECE_PATTERN), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(specials)
    # every word is an added token too, matched before any pre-tokenizer (see rl360.quickstart.assets)
    core.add_tokens([AddedToken(word, normalized=False, special=False) for word in words])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=None, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", unk_token="<unk>",
                                        chat_template=VISION_CHAT_TEMPLATE)
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def build_image_processor(out_dir: str | Path, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> None:
    """Qwen2-VL's image processor settings (preprocessor_config.json) and the processor's chat template
    (chat_template.jinja), as `AutoProcessor.save_pretrained` of Qwen2.5-VL writes them."""
    out_dir = Path(out_dir)
    config = {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "do_convert_rgb": True, "do_resize": True, "do_rescale": True, "do_normalize": True,
        "rescale_factor": 1 / 255, "resample": 3,  # bicubic
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "patch_size": PATCH_SIZE, "merge_size": MERGE_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "min_pixels": min_pixels, "max_pixels": max_pixels,
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(VISION_CHAT_TEMPLATE)


def build_vision_model(out_dir: str | Path, tokenizer: PreTrainedTokenizerFast, seed: int = 0,
                       initializer_range: float = 0.1, family: str = "qwen2_5_vl",
                       tie_word_embeddings: bool = True) -> None:
    """A tiny Qwen2.5-VL (or, `family="qwen2_vl"`, Qwen2-VL) with random weights, its special token ids taken
    from `tokenizer`."""
    import transformers

    torch.manual_seed(seed)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    text = {
        "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        "initializer_range": initializer_range, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None,
    }
    patches = {"patch_size": PATCH_SIZE, "spatial_merge_size": MERGE_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE,
               "depth": 2, "num_heads": 2, "initializer_range": initializer_range}
    if family == "qwen2_5_vl":
        config_class, model_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
        vision = {**patches, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 64, "window_size": 56,
                  "fullatt_block_indexes": [1]}
    elif family == "qwen2_vl":
        config_class, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
        vision = {**patches, "embed_dim": 32, "mlp_ratio": 2, "hidden_size": 64}
    else:
        raise ValueError(f"family={family!r}: choose qwen2_5_vl or qwen2_vl")
    config = config_class(text_config=text, vision_config=vision, tie_word_embeddings=tie_word_embeddings,
                          image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                          vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    model_class(config).save_pretrained(str(out_dir))


def build_vision_quickstart_model(out_dir: str | Path, texts: Iterable[str] = (), seed: int = 0,
                                  min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS,
                                  family: str = "qwen2_5_vl", tie_word_embeddings: bool = True,
                                  added_tokens: Iterable[str] = (), max_answer: int = 18) -> Path:
    """Tokenizer (spelling `texts`, `added_tokens` whole, answers `\\boxed{0}` ... `\\boxed{max_answer}`), image
    processor, chat template and model in one Hugging Face directory; returns it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_vision_tokenizer(out_dir, texts, max_answer=max_answer, added_tokens=added_tokens)
    build_image_processor(out_dir, min_pixels, max_pixels)
    build_vision_model(out_dir, tokenizer, seed=seed, family=family, tie_word_embeddings=tie_word_embeddings)
    (out_dir / "rl360_quickstart.json").write_text(json.dumps({"seed": seed, "vision": True}) + "\n")
    return out_dir



def _first_position(model_dir: Path, question: str, image_png: bytes):
    """The saved model and, at the first position of its reply to `question` (the user's text, `<image>` where the
    image goes) about `image_png`, its logits and final hidden state."""
    import io

    import transformers
    from PIL import Image

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    processor = transformers.Qwen2VLImageProcessor.from_pretrained(str(model_dir))
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(model_dir))
    pixels = processor(images=[Image.open(io.BytesIO(image_png)).convert("RGB")], return_tensors="pt")
    before, _, after = question.partition("<image>")
    content = [{"type": "text", "text": before}, {"type": "image"}, {"type": "text", "text": after}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    pads = int(pixels["image_grid_thw"].prod()) // MERGE_SIZE**2
    text = text.replace("<|image_pad|>", "<|image_pad|>" * pads)
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                    output_hidden_states=True)
    return model, tokenizer, out.logits[0, -1].double(), out.hidden_states[-1][0, -1]  # the last: after the norm


def first_token_probability(model_dir: str | Path, token: str, question: str, image_png: bytes) -> float:
    """The saved model's probability of writing `token` first in its reply to `question` about `image_png`."""
    _, tokenizer, logits, _ = _first_position(Path(model_dir), question, image_png)
    return logits.softmax(-1)[tokenizer.convert_tokens_to_ids(token)].item()


def prime_first_token(model_dir: str | Path, token: str, question: str, image_png: bytes, probability: float,
                      keep: torch.Tensor | None = None) -> None:
    """Raise the saved model's probability of writing `token` first in its reply to `question` about `image_png` to
    `probability`, by adding the final hidden state's direction there to the token's (tied) embedding: a prior like
    an instruct model's habit of calling its tools, which tells nothing about the answer. `keep`: a final hidden
    state where the token's probability is to stay about as it is (`raise_token_prior`)."""
    model, tokenizer, logits, hidden = _first_position(Path(model_dir), question, image_png)
    if not model.config.tie_word_embeddings:
        raise ValueError("prime_first_token: the model's input and output embeddings must be tied")
    raise_token_prior(model.get_input_embeddings().weight, tokenizer.convert_tokens_to_ids(token), logits.double(),
                      hidden.double(), probability, None if keep is None else keep.double())
    model.save_pretrained(str(model_dir))
