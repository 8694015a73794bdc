"""How the loop shows tool replies to the model: the chat messages of one turn's replies.

A reply format is a function `format(replies, first_image) -> messages`: `replies` are the turn's calls as the
loop shows them (`ShownReply`: the tool's name, its `ToolReply`, the Qwen-VL placeholders of the images shown, the
count of images not shown), `first_image` the number of images the trajectory held before these (the prompt's
first image is image 0). The messages are rendered by the tokenizer's chat template after the turn. A parser
names its format as `parser.reply_format`; without one the loop uses `tool_messages`.

- `tool_messages`: one `tool` message per call (Qwen's chat templates wrap each in `<tool_response>`): the
  images' placeholders, the text, a note on images not shown, and `Error: ...`.
- `interpreter_messages`: PyVision-RL's replies: one `observation` message per call holding
  `<interpreter>Text Result:\\n...</interpreter>\\n`; with images, `Image Result:` and each image's placeholder
  in `<image_clue_N>...</image_clue_N>` tags, N counting on from the trajectory's images (the prompt's are
  image_clue_0, ...), as PyVision's code names them; a call that failed to run `<interpreter>Execution error:
  ...</interpreter>\\n` (the error alone, as PyVision shows it), one that could not be read (no code, no answer)
  `<interpreter>Error: ...</interpreter>\\n`.
  Qwen2.5-VL's chat template renders a role it does not know as `<|im_start|>observation\\n...<|im_end|>`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rl360.agents.tools.base import ToolReply


@dataclass(frozen=True)
class ShownReply:
    """One call's reply as the model sees it: `images` are the placeholders of the images shown (in order),
    `dropped` the images not shown (a conversation without images)."""

    name: str
    reply: ToolReply
    images: tuple[str, ...] = ()
    dropped: int = 0


ReplyFormat = Callable[[list[ShownReply], int], list[dict[str, str]]]


def _not_shown(dropped: int) -> str:
    return f"[{dropped} image(s) not shown: this conversation has no images]"


def tool_messages(replies: list[ShownReply], first_image: int) -> list[dict[str, str]]:
    """One chat `tool` message per reply: its images' placeholders, its text, its error."""
    messages = []
    for shown in replies:
        parts = list(shown.images)
        if shown.reply.text:
            parts.append(shown.reply.text)
        if shown.dropped:
            parts.append(_not_shown(shown.dropped))
        if shown.reply.error:
            parts.append(f"Error: {shown.reply.error}")
        messages.append({"role": "tool", "name": shown.name or "unknown", "content": "\n".join(parts)})
    return messages


def interpreter_messages(replies: list[ShownReply], first_image: int) -> list[dict[str, str]]:
    """PyVision's `observation` messages, one per reply (see the module docstring)."""
    messages, number = [], first_image
    for shown in replies:
        text = shown.reply.text.strip()
        if shown.dropped:
            text = f"{text}\n{_not_shown(shown.dropped)}".strip()
        if shown.reply.failed:  # PyVision-RL: "Execution error: " for code that ran, "Error: " for a turn unread;
            # as PyVision shows it, the error alone (what the cell printed before it is not shown)
            kind = "Execution error: " if shown.name else "Error: "
            head = kind + (shown.reply.error or "Execution timeout")
        else:
            head = f"Text Result:\n{text}"
        if shown.images:  # every image shown has its placeholder here, a failed call's too
            clues = "".join(f"<image_clue_{number + k}>{placeholder}</image_clue_{number + k}>"
                            for k, placeholder in enumerate(shown.images))
            number += len(shown.images)
            content = f"<interpreter>{head}\nImage Result:\n{clues}</interpreter>\n"
        else:
            content = f"<interpreter>{head}</interpreter>\n"
        messages.append({"role": "observation", "content": content})
    return messages
