"""Format and length rewards, as plain functions to compose in a domain's reward (they are registered under
no data_source: a format term is added to a correctness score, e.g. `0.9 * correct + 0.1 * format`).

- `think_format(text)`: 1.0 for one `<think>…</think>` block first, then a non-empty answer.
- `tags_format(text, tags)`: 1.0 when each tag appears exactly once, opened and closed, in this order, with
  nothing but whitespace between blocks — e.g. the Lewis-game speaker's
  `<thinking>…</thinking><coarse>…</coarse><detailed>…</detailed>` (`LEWIS_SPEAKER_TAGS`).
- `one_sentence(text)`: 1.0 when the text is exactly one sentence (the Lewis game's length reward gives
  0.1 for that: `0.1 * one_sentence(detailed)`).
- `length_score(num_tokens, target, tolerance)`: 1.0 within `tolerance` tokens of `target`, falling
  linearly to 0 at twice the tolerance. DAPO's overlong penalty is `reward.overlong_buffer_len`.
"""

from __future__ import annotations

import re

LEWIS_SPEAKER_TAGS = ("thinking", "coarse", "detailed")


def think_format(text: str) -> float:
    match = re.fullmatch(r"\s*<think>(.*?)</think>(.*)", text, flags=re.DOTALL)
    ok = match is not None and "<think>" not in match.group(1) and "</think>" not in match.group(2) \
        and match.group(2).strip() != ""
    return float(ok)


def tags_format(text: str, tags: tuple[str, ...] = LEWIS_SPEAKER_TAGS) -> float:
    blocks = "".join(rf"\s*<{tag}>(?:(?!</?{tag}>).)*?</{tag}>" for tag in tags)
    if re.fullmatch(blocks + r"\s*", text, flags=re.DOTALL) is None:
        return 0.0
    return float(all(text.count(f"<{tag}>") == 1 and text.count(f"</{tag}>") == 1 for tag in tags))


def tag_content(text: str, tag: str) -> str | None:
    """The text inside the last <tag>…</tag>, or None."""
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
    return found[-1].strip() if found else None


def one_sentence(text: str) -> float:
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]
    return float(len(sentences) == 1 and bool(re.search(r"[.!?]$", text.strip())))


def length_score(num_tokens: int, target: int, tolerance: int) -> float:
    excess = abs(num_tokens - target) - tolerance
    return 1.0 if excess <= 0 else max(0.0, 1.0 - excess / max(tolerance, 1))
