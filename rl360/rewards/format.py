"""Format and length rewards, as plain functions to compose in a domain's reward.

None is registered under a data_source by itself: a format term is meant to be added to a correctness score,
e.g. `0.9 * correct + 0.1 * think_format(response)`. Write that sum in a module-level function of your own and
register it (`@rl360.rewards.register_reward("mydomain")`, or `reward.custom` in the config), as
`rl360.rewards.lewis.speaker_reward` does for the Lewis game's speaker: the listener's accuracy
+ `tags_format(response, LEWIS_SPEAKER_TAGS)` + `0.1 * one_sentence(detailed)`.

- `think_format(text)`: 1.0 for one `<think>…</think>` block first, then a non-empty answer
  (`think_in_prompt=True` when the chat template opens `<think>` in the prompt).
- `tags_format(text, tags)`: 1.0 when each tag is opened and closed exactly once and no block sits inside
  another, as the Lewis game's format reward asks of the speaker's
  `<thinking>…</thinking><coarse>…</coarse><detailed>…</detailed>` (`LEWIS_SPEAKER_TAGS`); `strict=True`
  also asks for that order with nothing but whitespace around and between the blocks.
- `tag_content(text, tag)`: the text inside the last `<tag>…</tag>`.
- `one_sentence(text)`: 1.0 when the text is exactly one sentence ending in . ! or ? (the Lewis game's
  length reward gives 0.1 for that: `0.1 * one_sentence(detailed)`).
- `length_score(num_tokens, target, tolerance)`: 1.0 within `tolerance` tokens of `target`, falling
  linearly to 0 at twice the tolerance. DAPO's overlong penalty is the trainer's `reward.overlong_buffer_len`.
"""

from __future__ import annotations

import re

LEWIS_SPEAKER_TAGS = ("thinking", "coarse", "detailed")


def think_format(text: str, think_in_prompt: bool = False) -> float:
    """1.0 when `text` is one `<think>…</think>` block (leading whitespace aside) and then a non-empty answer;
    with `think_in_prompt`, the response starts inside the block: one `</think>`, no `<think>`."""
    if think_in_prompt:
        ok = text.count("</think>") == 1 and "<think>" not in text and text.split("</think>")[1].strip() != ""
        return float(ok)
    match = re.fullmatch(r"\s*<think>(.*?)</think>(.*)", text, flags=re.DOTALL)
    ok = match is not None and "<think>" not in match.group(1) and "</think>" not in match.group(2) \
        and "<think>" not in match.group(2) and match.group(2).strip() != ""
    return float(ok)


def tags_format(text: str, tags: tuple[str, ...] = LEWIS_SPEAKER_TAGS, strict: bool = False) -> float:
    """1.0 when every tag in `tags` is opened and closed exactly once and no block overlaps another; with
    `strict`, the blocks also come in the order of `tags` with only whitespace around them."""
    if not all(text.count(f"<{tag}>") == 1 and text.count(f"</{tag}>") == 1 for tag in tags):
        return 0.0
    spans = sorted((text.index(f"<{tag}>"), text.index(f"</{tag}>") + len(tag) + 3) for tag in tags)
    if any(start >= end for start, end in spans) or any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        return 0.0  # a tag closed before it opens, or a block inside another
    if strict:
        blocks = "".join(rf"\s*<{tag}>.*?</{tag}>" for tag in tags)
        return float(re.fullmatch(blocks + r"\s*", text, flags=re.DOTALL) is not None)
    return 1.0


def tag_content(text: str, tag: str) -> str | None:
    """The text inside the last <tag>…</tag>, stripped, or None."""
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
    return found[-1].strip() if found else None


def one_sentence(text: str) -> float:
    """1.0 when `text` is one sentence: no . ! or ? followed by more text, and one at its end."""
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]
    return float(len(sentences) == 1 and bool(re.search(r"[.!?]$", text.strip())))


def length_score(num_tokens: int, target: int, tolerance: int) -> float:
    """1.0 within `tolerance` of `target`, then falling linearly to 0.0 at `2 * tolerance` away."""
    excess = abs(num_tokens - target) - tolerance
    return 1.0 if excess <= 0 else max(0.0, 1.0 - excess / max(tolerance, 1))
