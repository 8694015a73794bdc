"""Stop strings over tokens decoded one at a time: SGLang's `stop` sampling parameter, OpenAI's `stop`.

A row stops at the token whose decoding completes one of its stop strings; that token is the last of the
response (the tokens are the ones sampled, which RL trains on), and the response's text is cut before the stop
string (SGLang's `no_stop_trim` keeps it). The finish reason names the string: `{"type": "stop", "matched": s}`.

The text grows token by token by incremental detokenization: each new token's text is the decoding of a short
window of recent tokens past the decoding of the window without it, so a tokenizer's word-start markers decode
as they do in the whole text and a token that ends inside a UTF-8 character waits for the rest. A stop string is
looked for only in the text that may hold a new one (the new text and the few characters before it that could
begin a stop string), so each token costs O(window + longest stop string), whatever the response's length.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from rl360.core.trajectory import Sample


class IncrementalText:
    """The text of a token sequence, one token at a time: `push(token)` returns the text that token adds ("" while
    it ends inside a character)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.tokens: list[int] = []
        self._prefix = self._read = 0  # the window: tokens[prefix:read] are already in the text

    def push(self, token: int) -> str:
        self.tokens.append(token)
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        known = decode(self.tokens[self._prefix:self._read], skip_special_tokens=skip)
        grown = decode(self.tokens[self._prefix:], skip_special_tokens=skip)
        if len(grown) <= len(known) or grown.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.tokens)
        return grown[len(known):]


@dataclass(frozen=True)
class StopMatch:
    """A stop string found: the string, where it starts in the text, and the tokens up to the one completing it."""

    string: str
    start: int  # character offset in the text
    tokens: int  # tokens of the response, the completing one included


class StopMatcher:
    """Finds the first stop string in the text of tokens pushed one at a time."""

    def __init__(self, tokenizer: Any, stop: list[str], skip_special_tokens: bool = False):
        self.stop = [s for s in stop if s]
        self.text = IncrementalText(tokenizer, skip_special_tokens)
        self.length = 0  # characters of text so far
        self._tail = ""  # the last characters, as many as could begin a stop string
        self._keep = max((len(s) for s in self.stop), default=1) - 1

    def push(self, token: int) -> tuple[str, StopMatch | None]:
        """Add a token: the text it adds and the stop string it completes (None: none), the one starting first."""
        piece = self.text.push(token)
        if not piece or not self.stop:
            return piece, None
        window = self._tail + piece
        base = self.length - len(self._tail)
        found = [(i, order, s) for order, s in enumerate(self.stop)
                 if (i := window.find(s, max(0, len(self._tail) - len(s) + 1))) >= 0]
        self.length += len(piece)
        self._tail = window[-self._keep:] if self._keep else ""
        if not found:
            return piece, None
        start, _, string = min(found)
        return piece, StopMatch(string, base + start, len(self.text.tokens))


def first_stop(tokens: list[int], tokenizer: Any, stop: list[str]) -> StopMatch | None:
    """The first stop string in the text of `tokens` (decoded as the engines decode them), None when none is."""
    matcher = StopMatcher(tokenizer, stop)
    for token in tokens:
        _, match = matcher.push(token)
        if match is not None:
            return match
    return None


def cut_at_stop(sample: Sample, tokenizer: Any, stop: list[str]) -> Sample:
    """`sample` ended at the token completing its first stop string, as an engine ends it (finish "stop", the
    string in `stop_matched`); unchanged when it holds none, already ends there, or was aborted. A sample
    continued after a cut (a partial rollout) needs it: the engine that continued it saw only the tokens after
    the cut, so a stop string spanning the cut went unseen."""
    if not stop or sample.finish_reason not in ("stop", "length"):
        return sample
    match = first_stop(sample.response_ids, tokenizer, stop)
    if match is None or (match.tokens == len(sample.response_ids) and sample.stop_matched == match.string):
        return sample
    k = match.tokens
    versions = sample.token_versions[:k] if sample.token_versions else sample.token_versions
    mask = sample.loss_mask[:k] if sample.loss_mask is not None else None
    turns = None
    if sample.turns is not None:
        turns = [replace(turn, end=min(turn.end, k)) for turn in sample.turns if turn.start < k]
    return replace(sample, response_ids=sample.response_ids[:k], logprobs=sample.logprobs[:k], finish_reason="stop",
                   token_versions=versions, loss_mask=mask, turns=turns, stop_matched=match.string)
