"""One generate call's sampling settings, as every engine takes them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    n: int = 1  # responses per prompt
    temperature: float = 1.0  # 0: greedy (the most likely token at every step)
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)  # generation ends after any of these
    # stop strings: generation ends at the token whose text completes one of them (that token included; SGLang's
    # `stop`, rl360/engine/stop_strings.py)
    stop: list[str] = field(default_factory=list)
    seed: int = 0  # seeds this call's sampling
    # penalties on the logits before temperature (rl360/engine/penalties.py): per occurrence and once per token of
    # the generated text (OpenAI's), and HF's divide/multiply over the prompt and generated tokens (1: off)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # MoE routing replay: each sample carries the experts every token was routed to (`Sample.routed_experts`; on
    # SGLang's API the request field `return_routed_experts`)
    routed_experts: bool = False
