"""The agent loop: one prompt -> one multi-turn trajectory `Sample`, tools called between turns.

    sample = await run_agent(generate_turn, prompt, tokenizer, tools, get_parser("hermes"), settings, params, seed)

`generate_turn(prompt, params, seed)` is any engine's single-response generate (it returns one continuation
`Sample`: tokens, the engine's log-probs, weight version); the loop:

1. generates a turn from the prompt (then from the trajectory so far), at most the response tokens left (and at
   most `max_turn_tokens`, when set);
   with `stop_after_call`, the parser's `call_end` is one of the engine's stop strings (`SamplingParams.stop`)
   and an added token whose text ends with it (Qwen's `</tool_call>`) a stop token, so the turn ends at the
   token that closes a call, as at the end-of-turn token, also where several tokens spell the closing
   (PyVision's `</code>` is three of Qwen's tokens): the engine decodes nothing past it;
2. parses the turn's tool calls (of the whole turn, see partial rollouts below); none, or a turn cut by the
   length limit or aborted, ends the trajectory; so
   does a turn that sampled the image token (`<|image_pad|>`): an engine handed it back in the next turn's
   context would take it for an image's place (finish "image_token");
3. runs the calls: different tools concurrently, calls of one tool in the order written (they may share the
   trajectory's state, e.g. the python tool's interpreter); a failing, hanging or unknown call becomes an error
   reply; each tool's `prepare` runs when the trajectory begins (the python tool fills its warm pool of
   interpreters meanwhile), and when it ends, however it ends, each tool's `release` frees what it holds for it;
4. renders the replies with the tokenizer's chat template, as the parser's `reply_format` writes them (default
   `tool` messages; `rl360.agents.replies`), and appends exactly the tokens the template adds after the turn
   (the turn's closing, the reply block, the next assistant header), with loss mask 0 and log-prob 0
   (`Sample.then`), so the trainer sees the very tokens the engine was fed;
5. goes on, up to `max_turns` generated turns and `max_response_length` response tokens (generated and
   inserted together; a reply that would leave no room for one more generated token ends the trajectory,
   finish reason "length").

Partial rollouts (`rollout.partial`): a weight update that aborts a turn in flight does not end the trajectory.
The training sampler's `generate_turn` is the engine fleet's `generate`, which continues every sample a pause
aborted (`EngineFleet._continue`: it waits for the new weights and draws the rest of the turn from the
trajectory's context + the turn's tokens so far, with the context's images, within the turn's token budget);
so the loop gets the whole turn back, its tokens tagged with the version that drew each (`Sample.token_versions`,
log-probs of that version) and `resumed` set, parses the whole turn's text, keeps its tool state and records
one turn (`TurnRecord.resumed`, `agent/cut_turns`). Only a `generate_turn` that hands back an "abort" (one that
does not continue, e.g. an engine called directly) ends the trajectory, ended_by "abort".

The tool tokens are found as verl and slime do: render a fixed dummy conversation ending in an assistant
message, with and without the tool messages (and the generation prompt), and take the difference. That needs
a template whose rendering of an assistant message does not change once tool messages follow it. Qwen2.5's,
Hermes' and Llama's render every message as it is. Qwen3's drops the reasoning (`<think>...</think>`) of the
assistant turns before the last user message, and adds an empty `<think>` block to the last assistant turn
when it has none; the dummy reply carries a reasoning block, so both renderings keep it and agree. A trajectory
has one user message, so every turn in it comes after the last one: the context the loop builds, the engine's
tokens as generated plus the tool tokens, is the template's rendering of the whole conversation, thinking
included, as Qwen3 renders multi-step tool use.

Images: a tool's images are attached to the trajectory in order (`Sample.images`, after the prompt's) and
written into the tool message as Qwen-VL's placeholder (vision start, one image pad per merged patch, vision
end), so the next turn's `ImagePrompt` has the ids the processor would produce. Only an `ImagePrompt` takes
them; for a text prompt they are dropped and the reply says so. The trainer trains on such trajectories as the
engine sampled them: `build_batch` carries every image of a row (`Sample.images`), the policy computes the
M-RoPE positions over the whole trajectory with every image's grid and feeds each image's pixels at its image
tokens, those of the prompt and those inside the response's tool tokens (`rl360.actor.multimodal`); an
image-token id the engine sampled is text there, as it was to the engine. `agent.min_pixels`/`max_pixels` must
lie within the model processor's bounds, or the placeholder's token count is not the one the engine and
trainer expand the image into (checked when the run starts).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from rl360.agents.parsers import Parser, ParseResult, ToolCall
from rl360.agents.replies import ShownReply, tool_messages
from rl360.agents.tools.base import Tool, ToolReply, TrajectoryState, prepare_tools, release_tools
from rl360.agents.tools.images import IMAGE_PAD, qwen_vl_placeholder
from rl360.config import AgentConfig, RolloutConfig
from rl360.core.prompt import ImagePrompt, Prompt, prompt_ids, prompt_images
from rl360.core.sampling import SamplingParams
from rl360.core.trajectory import Sample, TrajectorySummary

GenerateTurn = Callable[[Prompt, SamplingParams, int], Awaitable[Sample]]
_AGENT, _ROLLOUT = AgentConfig(), RolloutConfig()  # the config sections' defaults, defined there once


@dataclass(frozen=True)
class AgentSettings:
    """What bounds one trajectory (from the `agent` and `rollout` config sections, whose defaults are these)."""

    max_turns: int = _AGENT.max_turns  # generated turns
    max_response_length: int = _ROLLOUT.max_response_length  # response tokens, generated and inserted together
    tool_timeout_s: float = _AGENT.tool_timeout_s  # per call, for tools that do not enforce their own (python does)
    min_pixels: int = _AGENT.min_pixels  # Qwen-VL image bounds, for the placeholder of an image a tool returns
    max_pixels: int = _AGENT.max_pixels
    # a turn ends at a token that closes a tool call (see the module docstring)
    stop_after_call: bool = _AGENT.stop_after_call
    # the trajectories' turns in step, one request a round (`rl360.agents.group`)
    batch_turns: bool = _AGENT.batch_turns
    # generated tokens of one turn at most (0: only max_response_length bounds it)
    max_turn_tokens: int = _AGENT.max_turn_tokens


@dataclass(frozen=True)
class CallRecord:
    """One tool call: the tool, whether it failed (and why), timed out, and how long it took."""

    name: str
    error: str = ""
    timed_out: bool = False
    seconds: float = 0.0
    images: int = 0


@dataclass(frozen=True)
class TurnRecord:
    """One generated turn: its tokens, its finish reason, its calls and the tool tokens inserted after it, and
    how many times it was cut (by a weight update under `rollout.partial`, or by a failed engine) and continued
    from where it was: a cut turn is still one turn."""

    generated_tokens: int
    finish_reason: str
    calls: tuple[CallRecord, ...] = ()
    tool_tokens: int = 0
    tool_seconds: float = 0.0
    resumed: int = 0


@dataclass(frozen=True)
class AgentTrace:
    """How a trajectory went: its turns, and what ended it: "done" (a turn without calls), "max_turns",
    "budget" (the response-token budget), "length" (a turn cut by the budget), "abort" or "image_token" (a turn
    with calls that sampled the image token, which no engine can be handed back as text)."""

    turns: tuple[TurnRecord, ...] = ()
    ended_by: str = "done"
    images_dropped: int = 0

    @property
    def calls(self) -> list[CallRecord]:
        return [call for turn in self.turns for call in turn.calls]


@dataclass
class AgentSample(Sample):
    """A trajectory `Sample` with how it went (`trace`)."""

    trace: AgentTrace = field(default_factory=AgentTrace)

    @property
    def ended_by(self) -> str:
        return self.trace.ended_by

    def summary(self, decode: Callable[[list[int]], str]) -> TrajectorySummary:
        """The generated turns' texts (`Sample.summary`) with the trace's calls and errors."""
        calls = self.trace.calls
        return replace(super().summary(decode), tool_calls=dict(Counter(call.name for call in calls)),
                       tool_errors=sum(bool(call.error or call.timed_out) for call in calls),
                       tool_timeouts=sum(call.timed_out for call in calls))


async def run_agent(generate_turn: GenerateTurn, prompt: Prompt, tokenizer: Any, tools: dict[str, Tool],
                    parser: Parser, settings: AgentSettings, params: SamplingParams | None = None,
                    seed: int = 0, tool_kwargs: dict[str, dict[str, Any]] | None = None) -> AgentSample:
    """One trajectory from `prompt` (already rendered with the chat template and its generation prompt); see
    the module docstring. `tool_kwargs`: each tool's `create_kwargs` for this trajectory, by tool name."""
    state = TrajectoryState(images=list(prompt_images(prompt) or ()), seed=seed, kwargs=dict(tool_kwargs or {}))
    try:
        prepare_tools(tools, state)
        return await _trajectory(generate_turn, prompt, tokenizer, tools, parser, settings, params, seed, state)
    finally:  # however it ends (an exception, a cancel too): the tools free what they hold for it
        release_tools(tools, state)


async def _trajectory(generate_turn: GenerateTurn, prompt: Prompt, tokenizer: Any, tools: dict[str, Tool],
                      parser: Parser, settings: AgentSettings, params: SamplingParams | None, seed: int,
                      state: TrajectoryState) -> AgentSample:
    params = params or SamplingParams()
    images = list(prompt_images(prompt) or ())
    sample: Sample | None = None
    turns: list[TurnRecord] = []
    ended_by, dropped, context = "done", 0, prompt
    pending: list[int] = []  # the tool tokens after the last turn, before the next
    image_pad = _token_id(tokenizer, IMAGE_PAD)
    reply_format = getattr(parser, "reply_format", None) or tool_messages
    if settings.stop_after_call:
        params = replace(params, stop_token_ids=sorted({*params.stop_token_ids, *call_end_ids(tokenizer, parser)}),
                         stop=list(dict.fromkeys([*params.stop, parser_call_end(parser)])))
    for turn in range(settings.max_turns):
        used = len(sample.response_ids) + len(pending) if sample else 0
        budget = settings.max_response_length - used
        if settings.max_turn_tokens:
            budget = min(budget, settings.max_turn_tokens)
        more = await generate_turn(context, replace(params, n=1, max_new_tokens=budget), _turn_seed(seed, turn))
        if sample is not None:
            sample = sample.then(pending, more)
        else:
            sample = more
        text = tokenizer.decode(more.response_ids, skip_special_tokens=False)
        parsed = parser(text) if more.finish_reason == "stop" else ParseResult()
        if not parsed.calls:
            turns.append(TurnRecord(len(more.response_ids), more.finish_reason, resumed=more.resumed))
            ended_by = {"stop": "done", "length": "length"}.get(more.finish_reason, "abort")
            break
        if turn + 1 == settings.max_turns or (image_pad is not None and image_pad in more.response_ids):
            turns.append(TurnRecord(len(more.response_ids), more.finish_reason, resumed=more.resumed))
            ended_by = "max_turns" if turn + 1 == settings.max_turns else "image_token"
            break
        started = time.monotonic()
        replies = await _run_calls(parsed.calls, tools, state, settings)
        seconds = time.monotonic() - started
        shown, new_images = [], []
        for call, (reply, _) in zip(parsed.calls, replies, strict=True):
            kept = list(reply.images) if isinstance(prompt, ImagePrompt) else []
            dropped += len(reply.images) - len(kept)
            placeholders = tuple(qwen_vl_placeholder(image, settings.min_pixels, settings.max_pixels) for image in kept)
            shown.append(ShownReply(call.name, reply, placeholders, len(reply.images) - len(kept)))
            new_images += kept
        pending = tool_tokens(tokenizer, text, reply_format(shown, len(images)))
        records = tuple(record for _, record in replies)
        turns.append(TurnRecord(len(more.response_ids), more.finish_reason, records, len(pending), seconds,
                                more.resumed))
        if len(sample.response_ids) + len(pending) >= settings.max_response_length:
            ended_by = "budget"
            break
        images += new_images
        state.images += new_images
        ids = prompt_ids(prompt) + sample.response_ids + pending
        context = ImagePrompt(ids, tuple(images)) if isinstance(prompt, ImagePrompt) else ids
    assert sample is not None
    if isinstance(prompt, ImagePrompt):
        sample = replace(sample, images=tuple(images))
    values = {item.name: getattr(sample, item.name) for item in fields(Sample)}
    return AgentSample(**values, trace=AgentTrace(tuple(turns), ended_by, dropped))


def _token_id(tokenizer: Any, token: str) -> int | None:
    """The id of the vocabulary token `token`, None when the tokenizer has none."""
    index = tokenizer.convert_tokens_to_ids(token)
    return None if index is None or index == tokenizer.unk_token_id else index


def parser_call_end(parser: Parser) -> str:
    """The text that closes the parser's calls (`parser.call_end`); `ValueError` when it names none."""
    end = getattr(parser, "call_end", "")
    if not end:
        raise ValueError("agent.stop_after_call: the parser names no call_end (the text that closes a call)")
    return end


def call_end_ids(tokenizer: Any, parser: Parser) -> list[int]:
    """The ids of the added tokens whose text ends with the parser's `call_end` (`</tool_call>` itself in Qwen's
    tokenizers), [] when none does (`</code>` is three tokens of Qwen's: the stop string `call_end` then ends
    the turn); `ValueError` when the parser names no call_end."""
    end = parser_call_end(parser)
    return sorted(index for token, index in tokenizer.get_added_vocab().items() if token.endswith(end))


def _turn_seed(seed: int, turn: int) -> int:
    return (seed * 1_000_003 + turn) % (1 << 31)


async def _run_calls(calls: tuple[ToolCall, ...], tools: dict[str, Tool], state: TrajectoryState,
                     settings: AgentSettings) -> list[tuple[ToolReply, CallRecord]]:
    """Every call's reply and record, in the calls' order: tools concurrently, one tool's calls in order."""
    results: list[tuple[ToolReply, CallRecord] | None] = [None] * len(calls)
    by_tool: dict[str, list[int]] = {}
    for index, call in enumerate(calls):
        by_tool.setdefault(call.name, []).append(index)

    async def run_group(indices: list[int]) -> None:
        for index in indices:
            results[index] = await _run_call(calls[index], tools, state, settings)

    await asyncio.gather(*(run_group(indices) for indices in by_tool.values()))
    return [result for result in results if result is not None]


async def _run_call(call: ToolCall, tools: dict[str, Tool], state: TrajectoryState,
                    settings: AgentSettings) -> tuple[ToolReply, CallRecord]:
    started = time.monotonic()
    if call.error:
        reply = ToolReply(error=call.error)
    elif call.name not in tools:
        named = sorted(name for name, tool in tools.items() if name == tool.name)
        reply = ToolReply(error=f"there is no tool {call.name!r}; the tools are {named}")
    else:
        tool = tools[call.name]
        try:
            if getattr(tool, "manages_timeout", False):
                reply = await tool.call(call.arguments, state)
            else:
                reply = await asyncio.wait_for(tool.call(call.arguments, state), settings.tool_timeout_s)
        except TimeoutError:
            reply = ToolReply(error=f"the tool ran past {settings.tool_timeout_s:g} s and was stopped", timed_out=True)
        except Exception as error:  # a tool's bug is the model's error message, not the trajectory's end
            reply = ToolReply(error=f"the tool failed: {type(error).__name__}: {error}")
        if not isinstance(reply, ToolReply):
            reply = ToolReply(error=f"the tool returned {type(reply).__name__}, not a ToolReply")
    record = CallRecord(call.name or "?", reply.error or ("timed out" if reply.timed_out else ""),
                        reply.timed_out, time.monotonic() - started, len(reply.images))
    return reply, record


_DUMMY_REPLY = "rl360 dummy reply"
# a reasoning block: a template that renders it only when an assistant turn ends the conversation or has one
# (Qwen3's) renders this turn the same with and without tool messages after it
_DUMMY = [{"role": "system", "content": "rl360 dummy system"}, {"role": "user", "content": "rl360 dummy user"},
          {"role": "assistant", "content": f"<think>\nrl360 dummy thought\n</think>\n\n{_DUMMY_REPLY}"}]


def check_chat_template(tokenizer: Any, parser: Parser) -> None:
    """`ValueError` when the tokenizer's chat template cannot carry `parser`'s tool replies (`tool_tokens`): said
    when a run starts, not at its first tool call."""
    reply_format = getattr(parser, "reply_format", None) or tool_messages
    tool_tokens(tokenizer, "", reply_format([ShownReply("tool", ToolReply("rl360 dummy output"))], 0))


def tool_tokens(tokenizer: Any, generated: str, messages: list[dict[str, str]]) -> list[int]:
    """The tokens the chat template puts after an assistant turn the engine generated as `generated`: the rest
    of the turn's closing (what the engine did not generate of it), the `messages` (tool role) and the next
    assistant header. `ValueError` when the template renders earlier messages differently once later ones
    follow."""
    base = tokenizer.apply_chat_template(_DUMMY, tokenize=False)
    full = tokenizer.apply_chat_template(_DUMMY + messages, tokenize=False, add_generation_prompt=True)
    if not full.startswith(base):
        raise ValueError("the chat template renders an assistant message differently when tool messages follow it; "
                         "the agent loop needs a template that renders earlier messages the same way")
    if messages and full == tokenizer.apply_chat_template(_DUMMY, tokenize=False, add_generation_prompt=True):
        roles = sorted({message["role"] for message in messages})
        raise ValueError(f"the chat template renders no message of role {roles}: the tool replies would not reach "
                         "the model; use a parser whose replies the model's template renders (a Qwen2.5 text "
                         "template renders only system, user, assistant and tool)")
    closing = base[base.rindex(_DUMMY_REPLY) + len(_DUMMY_REPLY):]
    done = next(k for k in range(len(closing), -1, -1) if generated.endswith(closing[:k]))
    return tokenizer.encode(closing[done:] + full[len(base):], add_special_tokens=False)
