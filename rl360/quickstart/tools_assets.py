"""The tools quickstart's tokenizer and random-weight Qwen2 model (nothing is downloaded).

The task (data_preprocess/synthetic_tools.py) asks for `a*b%7` of two 6-digit numbers, which a 2-layer model
cannot compute from its weights; the python tool can. The tokenizer is the arithmetic quickstart's word-level
one over this task's text, with the whole Hermes call `CALL` (python code printing `a * b % 7`, the row's `a`
and `b` bound in the tool's interpreter) as one token, and a chat template that renders `tool` messages as
Qwen2.5's does: `<tool_response>` blocks inside a user turn. So a trajectory that pays is three generated
tokens: `CALL` (the turn ends at a finished call), then, after the tool's reply, `\\boxed{d}` and `<|im_end|>`.
"""

from __future__ import annotations

import json
from pathlib import Path

from rl360.quickstart.assets import build_model, build_tokenizer

MODULUS = 7
CALL = ('<tool_call>\n{"name": "python", "arguments": {"code": "print(a * b % ' + str(MODULUS)
        + ')"}}\n</tool_call>')
WORDS = ["user", "assistant", "tool", "\n", " ", "*", "%", "<tool_response>", "</tool_response>", CALL]
# Qwen2.5's layout: consecutive tool messages share one user turn, each in a <tool_response> block.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tools_quickstart_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Tokenizer and model together in one Hugging Face directory; returns it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir, max_answer=MODULUS - 1, words=WORDS, chat_template=CHAT_TEMPLATE)
    build_model(out_dir, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, seed=seed)
    (out_dir / "rl360_quickstart.json").write_text(json.dumps({"seed": seed, "task": "tools"}) + "\n")
    return out_dir
