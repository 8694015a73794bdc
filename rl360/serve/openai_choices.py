"""One choice of an OpenAI reply followed as its tokens are decoded: its text (cut before the first stop string,
which also ends the decoding), the tokens and log-probs that text covers, and the pieces a stream sends next.

The text grows token by token by incremental detokenization (`skip_special_tokens`), and stop strings are found
as soon as they are complete, by the engines' own `rl360.engine.stop_strings.StopMatcher`; this gives each
token's character offset and makes the streamed pieces and the whole reply one text: a stream sends text up to
where it may still change (the start of a stop string) and each token's log-probs once its text is sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rl360.engine.generate_request import Row
from rl360.engine.stop_strings import StopMatcher

STOP_STRING_ABORT = "stop string"


@dataclass
class Piece:
    """What a choice adds since the last piece: text, the tokens whose text it completes (their positions in the
    reply's tokens), and, on the last piece, the finish reason."""

    text: str
    tokens: range
    finish_reason: str | None = None


class ChoiceTracker:
    """Follows one row (one choice): call `advance()` whenever the engine reports tokens."""

    def __init__(self, row: Row, index: int, tokenizer: Any, stop: list[str], eos_ids: set[int]):
        self.row, self.index, self.tokenizer, self.stop, self.eos_ids = row, index, tokenizer, stop, eos_ids
        self.offsets = [0]  # offsets[k]: length of the text of the first k tokens
        self.text = ""  # the text of the tokens checked so far, cut before a stop string
        self.end: int | None = None  # tokens in the reply once it is finished
        self.stopped_by_string = False
        self._matcher = StopMatcher(tokenizer, stop, skip_special_tokens=True)
        self.finish_reason: str | None = None
        self.sent_text = 0  # characters of `text` already handed out
        self.sent_tokens = 0  # tokens whose log-probs were handed out

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def advance(self) -> Piece | None:
        """The next piece (None: nothing new yet)."""
        if self.done:
            return None
        engine_finish = self.row.finish_reason  # read before the tokens: once set, the tokens are all there
        tokens = self.row.tokens[:]
        for k in range(len(self.offsets), len(tokens) + 1):
            piece, match = self._matcher.push(tokens[k - 1])
            self.text += piece
            self.offsets.append(len(self.text))
            if match is not None:  # a stop string: the reply ends before it; the engine stops decoding this row
                self.text, self.end, self.stopped_by_string = self.text[:match.start], k, True
                self.finish_reason = "stop"
                self.row.aborted = self.row.aborted or STOP_STRING_ABORT
                return self._piece(len(self.text), k)
        if engine_finish is not None:
            kind = engine_finish["type"]
            self.end = len(tokens) - (1 if kind == "stop" and tokens and tokens[-1] in self.eos_ids else 0)
            self.finish_reason = "length" if kind == "length" else "stop" if kind == "stop" else "abort"
            return self._piece(len(self.text), self.end)
        limit = self._settled(self.text)
        covered = self.sent_tokens
        while covered < len(tokens) and self.offsets[covered + 1] <= limit:
            covered += 1
        if limit == self.sent_text and covered == self.sent_tokens:
            return None
        return self._piece(limit, covered)

    def _settled(self, text: str) -> int:
        """How much of `text` can no longer change: all but an end that may begin a stop string."""
        whole = limit = len(text)
        for stop in self.stop:
            for size in range(min(len(stop) - 1, whole), 0, -1):
                if text[whole - size:whole] == stop[:size]:
                    limit = min(limit, whole - size)
                    break
        return max(limit, self.sent_text)

    def _piece(self, limit: int, covered: int) -> Piece:
        piece = Piece(self.text[self.sent_text:limit], range(self.sent_tokens, covered), self.finish_reason)
        self.sent_text, self.sent_tokens = limit, covered
        return piece

    @property
    def completion_tokens(self) -> int:
        """Tokens generated for this choice (an end-of-sequence token included; none past a stop string)."""
        return self.end if self.stopped_by_string else len(self.row.tokens)


class LogprobFormat:
    """Per-token log-probs in OpenAI's two shapes: chat's `logprobs.content` and completions' legacy lists."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self.special = special_ids(tokenizer)  # not in the text: not listed
        self._byte_of = _byte_level_alphabet(tokenizer)  # a byte-level BPE's character -> byte; None: not one

    def token_bytes(self, token: int) -> list[int]:
        """The token's UTF-8 bytes: a byte-level BPE token's own bytes (part of a character included), else its
        text's."""
        if self._byte_of is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if piece and all(c in self._byte_of for c in piece):
                return [self._byte_of[c] for c in piece]
        return list(self.token_text(token).encode("utf-8"))

    def token_text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token])
        return text

    def shown(self, row: Row, positions: range) -> list[int]:
        """The positions whose tokens the reply's text holds: special tokens, which the text leaves out, are not
        listed, so the listed tokens join to the text (as OpenAI's)."""
        return [i for i in positions if row.tokens[i] not in self.special]

    def chat(self, row: Row, positions: range) -> list[dict]:
        """`choices[].logprobs.content` entries for the tokens at `positions` (special ones left out)."""
        return [{**self._entry(row.tokens[i], row.logprobs[i]),
                 "top_logprobs": [self._entry(t, lp) for t, lp in row.top[i]] if row.top else []}
                for i in self.shown(row, positions)]

    def legacy(self, row: Row, positions: range, offsets: list[int], base: int = 0) -> dict:
        """Completions' `logprobs` (tokens, token_logprobs, top_logprobs, text_offset) for the tokens at
        `positions` (special ones left out); `top_logprobs` holds the k most likely and the sampled token."""
        positions = self.shown(row, positions)
        tops = []
        for i in positions:
            top = {self.token_text(t): lp for t, lp in (row.top[i] if row.top else [])}
            top.setdefault(self.token_text(row.tokens[i]), row.logprobs[i])
            tops.append(top)
        return {"tokens": [self.token_text(row.tokens[i]) for i in positions],
                "token_logprobs": [row.logprobs[i] for i in positions], "top_logprobs": tops,
                "text_offset": [base + offsets[i] for i in positions]}

    def _entry(self, token: int, logprob: float) -> dict:
        return {"token": self.token_text(token), "logprob": logprob, "bytes": self.token_bytes(token)}


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The tokens that decoding with `skip_special_tokens` leaves out: the special tokens and the added tokens
    marked special (a chat template's <|im_start|> among them)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset(getattr(tokenizer, "all_special_ids", ()) or ()) | frozenset(
        token_id for token_id, token in added.items() if getattr(token, "special", False))


def _byte_level_alphabet(tokenizer: Any) -> dict[str, int] | None:
    """Character -> byte of a tokenizer whose decoder is byte-level (GPT-2, Qwen, Llama 3); None otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or '"type":"ByteLevel"' not in json.dumps(json.loads(backend.to_str()).get("decoder"),
                                                                  separators=(",", ":")):
        return None
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}
