"""The tools quickstart's tokenizer and random-weight Qwen2 model (nothing is downloaded).

The task (data_preprocess/synthetic_tools.py) asks for `a*b%7` of two 6-digit numbers, which a 2-layer model
cannot compute from its weights; the python tool can. The tokenizer is the arithmetic quickstart's word-level
one over this task's text, with the whole Hermes call `CALL` (python code printing the answer token `\\boxed{d}`
for `a * b % 7`, the row's `a` and `b` bound in the tool's interpreter) as one token, and a ChatML chat template
with a `tool` turn. So a trajectory that pays is three generated tokens: `CALL` (the turn ends at a finished
call), then, after the tool's reply, a copy of the reply's `\\boxed{d}` and `<|im_end|>`.
"""

from __future__ import annotations

import json
from pathlib import Path

from rl360.quickstart.assets import build_model, build_tokenizer, prime_first_token
from rl360.quickstart.priming import prime_answers

MODULUS = 7
# The tool prints the answer as the answer token itself (`\\boxed{3}`; chr(92) is the backslash, so the call's
# own text holds no \\boxed{}): using the tool's reply is copying one token of the context.
CODE = "print(chr(92) + 'boxed{%d}' % (a * b % " + str(MODULUS) + "))"
CALL = "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": CODE}}) + "\n</tool_call>"
WORDS = ["user", "assistant", "tool", "\n", " ", "*", "%", CALL]
# ChatML with a `tool` turn (as Hermes renders tool replies): the reply, trimmed, between the turn markers.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = message['content'] | trim if message['role'] == 'tool' else message['content'] %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# The built model writes the call first in about this share of its replies, whatever the numbers asked about,
# and after a tool's reply repeats the reply's answer with about this probability.
CALL_PRIOR = 0.5
COPY_PRIOR = 0.4


def first_turns(prompts: list[str]) -> list[list[dict]]:
    """The conversations before a reply's first turn: the user's prompt."""
    return [[{"role": "user", "content": prompt}] for prompt in prompts]


def answer_turns(prompts: list[str], answers: list[str]) -> list[list[dict]]:
    """The conversations before the turn after a call: the prompt, the call and the tool's reply (the answer)."""
    return [[{"role": "user", "content": prompt}, {"role": "assistant", "content": CALL},
             {"role": "tool", "content": f"\\boxed{{{answer}}}"}]
            for prompt, answer in zip(prompts, answers, strict=True)]


def build_tools_quickstart_model(out_dir: str | Path, prompts: list[str], answers: list[str], seed: int = 0,
                                 call_prior: float = CALL_PRIOR, copy_prior: float = COPY_PRIOR) -> Path:
    """Tokenizer and model together in one Hugging Face directory; returns it. The model is primed over
    `prompts` (the task's user messages) and their `answers`, like an instruct model's habits, that tell nothing
    about an answer it has not been shown: to repeat the answer a tool printed with probability about
    `copy_prior` (`prime_answers` on the turn after a reply), then to write `CALL` first in about `call_prior` of
    its replies (`prime_first_token`), its probability of calling again after the tool's reply left as it was."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir, max_answer=MODULUS - 1, words=WORDS, chat_template=CHAT_TEMPLATE)
    build_model(out_dir, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, seed=seed)
    if copy_prior:
        contexts = [tokenizer.apply_chat_template(turns, add_generation_prompt=True, return_dict=True)["input_ids"]
                    for turns in answer_turns(prompts, answers)]
        prime_answers(out_dir, contexts, tokenizer.convert_tokens_to_ids([f"\\boxed{{{a}}}" for a in answers]),
                      copy_prior, seed=seed)
    if call_prior:
        prime_first_token(out_dir, CALL, first_turns(prompts), call_prior, keep=answer_turns(prompts, answers))
    (out_dir / "rl360_quickstart.json").write_text(json.dumps({"seed": seed, "task": "tools", "call_prior": call_prior,
                                                               "copy_prior": copy_prior}) + "\n")
    return out_dir
