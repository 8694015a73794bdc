"""The Lewis quickstart's two tiny random-weight models (nothing is downloaded).

- The speaker: a tiny Qwen2.5-VL (`rl360.quickstart.vision_assets`) that sees the target image and is asked to
  name its shape's colour. Its word-level tokenizer spells the instruction, the colours and the shapes; each
  colour word is primed in turn (`prime_first_token`, on one red image) to `SPEAKER_PRIOR` as its first token;
  the words primed first are diluted by the later ones, so the untrained speaker writes a colour word first about
  0.6 of the time (each between about 0.1 and 0.25, varying a little with the image but not towards the colour
  shown): a prior over words like an instruct model's, which says nothing about which colour it sees.
- The listener: a tiny text-only Qwen2 (`rl360.quickstart.assets`) that reads a candidate's caption and the
  description and answers Yes or No; "Yes" is primed to about `LISTENER_PRIOR` as its first token, whatever
  the caption and description.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from rl360.data.lewis import NO, YES, listener_question
from rl360.quickstart.assets import build_model, build_tokenizer
from rl360.quickstart.vision_assets import build_vision_quickstart_model, prime_first_token, words_of

SPEAKER_PRIOR = 0.2  # each colour word's probability as the untrained speaker's first token
LISTENER_PRIOR = 0.4  # "Yes" as the untrained listener's first token


def build_speaker(out_dir: str | Path, instruction: str, colours: list[str], shapes: list[str], image: bytes,
                  seed: int = 0) -> Path:
    out_dir = build_vision_quickstart_model(out_dir, texts=[instruction, *colours, *shapes], seed=seed)
    for colour in colours:
        prime_first_token(out_dir, colour, instruction, image, SPEAKER_PRIOR)
    (out_dir / "rl360_quickstart.json").write_text(json.dumps({"seed": seed, "task": "lewis-speaker"}) + "\n")
    return out_dir


def build_listener(out_dir: str | Path, colours: list[str], shapes: list[str], seed: int = 0) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sample = f"Image: {colours[0]} {shapes[0]}\n{listener_question(colours[0])}"
    words = ["user", "assistant", "system", "\n", " "] + words_of([sample, *colours, *shapes, YES, NO])
    tokenizer = build_tokenizer(out_dir, max_answer=0, words=list(dict.fromkeys(words)))
    build_model(out_dir, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, seed=seed)
    prime_text_token(out_dir, YES, [{"role": "user", "content": sample}], LISTENER_PRIOR)
    (out_dir / "rl360_quickstart.json").write_text(json.dumps({"seed": seed, "task": "lewis-listener"}) + "\n")
    return out_dir


def prime_text_token(model_dir: str | Path, token: str, messages: list[dict], probability: float) -> None:
    """Raise a saved text model's probability of writing `token` first in reply to `messages` to `probability`,
    by adding its final hidden state's direction there to the token's (tied) embedding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                        return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    logits, hidden = out.logits[0, -1].double(), out.hidden_states[-1][0, -1]
    index = tokenizer.convert_tokens_to_ids(token)
    others = torch.cat([logits[:index], logits[index + 1:]]).logsumexp(-1).item()
    target = others + math.log(probability / (1 - probability))
    with torch.no_grad():
        model.get_input_embeddings().weight[index] += (target - logits[index].item()) * hidden / hidden.dot(hidden)
    model.save_pretrained(str(model_dir))
