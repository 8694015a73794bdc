"""Repetition penalties on next-token logits, as OpenAI's API and SGLang define them, applied before temperature
(so greedy decoding is penalised too) and before top-k / top-p:

- `frequency_penalty` f (OpenAI, SGLang; in [-2, 2]): `logit[t] -= f * count[t]`, `count[t]` the times token t
  occurs in the text generated so far.
- `presence_penalty` p (OpenAI, SGLang; in [-2, 2]): `logit[t] -= p` once for every token t that occurs in the
  generated text.
- `repetition_penalty` r (Hugging Face's CTRL penalty, SGLang's; in (0, 2], 1 is off): for every token t of the
  prompt or the generated text, `logit[t] /= r` where it is positive and `logit[t] *= r` where it is not.

    state = PenaltyState.start(prompts, params, vocab, device)  # None when every penalty is off
    logits = state.apply(logits)   # [rows, vocab], before temperature
    state.add(tokens)              # each row's sampled token
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rl360.core import SamplingParams


def penalised(params: SamplingParams) -> bool:
    """Whether any penalty of `params` changes logits."""
    return params.frequency_penalty != 0 or params.presence_penalty != 0 or params.repetition_penalty != 1


@dataclass
class PenaltyState:
    """Per row: the counts of each token in its generated text, and which tokens its prompt holds."""

    params: SamplingParams
    counts: torch.Tensor  # [rows, vocab] float
    in_prompt: torch.Tensor  # [rows, vocab] bool

    @staticmethod
    def start(prompts: Sequence[Sequence[int]], params: SamplingParams, vocab: int,
              device: torch.device | str = "cpu") -> PenaltyState | None:
        if not penalised(params):
            return None
        in_prompt = torch.zeros(len(prompts), vocab, dtype=torch.bool, device=device)
        for row, ids in enumerate(prompts):
            if len(ids):
                in_prompt[row, torch.as_tensor(list(ids), dtype=torch.long, device=device)] = True
        return PenaltyState(params, torch.zeros(len(prompts), vocab, device=device), in_prompt)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [rows, vocab] (float) penalised by what each row's prompt and generated text hold."""
        p = self.params
        if p.repetition_penalty != 1:
            seen = self.in_prompt | (self.counts > 0)
            scaled = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits = torch.where(seen, scaled, logits)
        if p.frequency_penalty != 0:
            logits = logits - p.frequency_penalty * self.counts
        if p.presence_penalty != 0:
            logits = logits - p.presence_penalty * (self.counts > 0).to(logits.dtype)
        return logits

    def add(self, tokens: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Count each row's new token (`tokens` [rows]); `rows` (bool [rows]): only those rows' tokens."""
        ones = torch.ones(len(tokens), device=self.counts.device)
        if rows is not None:
            ones = ones * rows.to(ones.dtype)
        self.counts.scatter_add_(1, tokens.to(self.counts.device)[:, None].long(), ones[:, None])
