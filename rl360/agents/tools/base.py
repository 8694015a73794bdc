"""What a tool is, what it answers, the per-trajectory state it may keep, and the registry of tools.

A tool has a `name`, a `schema` (the OpenAI/Qwen function description: name, description, JSON-schema
parameters; the chat template shows it to the model) and `async call(arguments, state) -> ToolReply`. It is
built once per run from `ToolSettings` and shared by every trajectory, so whatever belongs to one trajectory
lives in the `TrajectoryState` it is handed. A tool that holds something per trajectory (the python tool's
interpreter) also has `release(state)`, which the agent loop calls once the trajectory ends, however it ends
(`release_tools`), and may have `prepare(state)`, called when the trajectory begins (`prepare_tools`). A tool
reports failure in its reply (`error`, `timed_out`), which the loop shows to the model and counts; an exception
escaping `call` is caught by the loop and treated the same way.

Built-ins are registered by name (`register_tool`); a user tool is named "package.module:Class" and built as
`Class(settings)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rl360.algos.registry import Registry
from rl360.config import AgentConfig

_AGENT = AgentConfig()  # the agent section's defaults: each tool limit is defined there, once


@dataclass(frozen=True)
class ToolSettings:
    """The limits every tool is built with (from the `agent` config section, whose defaults are these)."""

    timeout_s: float = _AGENT.tool_timeout_s  # wall clock per call
    memory_mb: int = _AGENT.tool_memory_mb  # memory of the code a call runs
    max_output_chars: int = _AGENT.max_tool_output_chars  # text of one reply, longer is cut (and counted as an error)
    max_pixels: int = _AGENT.max_pixels  # an image a tool returns is resized to at most this many pixels
    min_pixels: int = _AGENT.min_pixels  # ... and at least this many (28 x 28 x 4)
    max_image_tokens: int = _AGENT.max_image_tokens  # image tokens tools may add to one trajectory
    python: str = _AGENT.python  # interpreter of the python tool ("": the sandbox's own)
    # processes starting the python tool's interpreters (0: the CPU count; more when one is full)
    workers: int = _AGENT.tool_workers
    # fresh python interpreters kept started ahead of trajectories' first calls (0: none; a run takes
    # agent.tool_pool)
    pool: int = 0
    replay: bool = _AGENT.python_replay  # each python call in a new interpreter re-running the earlier cells


@dataclass
class TrajectoryState:
    """What the tools keep for one trajectory: its images so far (the prompt's, then those tools returned),
    the image tokens tools added, each tool's own entries under its name in `store`, and each tool's
    `create_kwargs` from the prompt row under its name in `kwargs` (verl's `extra_info.tools_kwargs.<tool>.
    create_kwargs`: what a tool starts the trajectory with, e.g. the python tool's `variables`)."""

    images: list[bytes] = field(default_factory=list)
    image_tokens: int = 0
    seed: int = 0
    store: dict[str, Any] = field(default_factory=dict)
    kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolReply:
    """A tool's answer: text for the model, images (PNG/JPEG bytes, in order), and `error` (shown to the
    model and counted) or `timed_out`."""

    text: str = ""
    images: tuple[bytes, ...] = ()
    error: str = ""
    timed_out: bool = False

    @property
    def failed(self) -> bool:
        return bool(self.error) or self.timed_out


@runtime_checkable
class Tool(Protocol):
    name: str
    schema: dict[str, Any]

    async def call(self, arguments: dict[str, Any], state: TrajectoryState) -> ToolReply: ...


TOOLS: Registry[Callable[[ToolSettings], Tool]] = Registry("tool")
register_tool = TOOLS.register  # class decorator: a built-in tool class under a name
registered_tools = TOOLS.names


def get_tool(name: str, settings: ToolSettings | None = None) -> Tool:
    """Build the tool `name` (a registered one, or "package.module:Class") with `settings`. `KeyError` naming
    the registered tools for an unknown name; `TypeError` when what a reference names is not a tool."""
    tool = TOOLS.get(name)(settings or ToolSettings())
    if not isinstance(tool, Tool) or not isinstance(tool.name, str) or not isinstance(tool.schema, dict):
        raise TypeError(f"tool {name!r} must have a str `name`, a dict `schema` and `async call(arguments, state)`")
    return tool


def build_tools(names: list[str] | tuple[str, ...], settings: ToolSettings | None = None) -> dict[str, Tool]:
    """The tools `names` by the names the model may call them: each tool's `name`, then its `aliases` (a tool's
    other names, where no tool has that name); `ValueError` when two tools share a name."""
    built = [get_tool(name, settings) for name in names]
    tools: dict[str, Tool] = {}
    for tool in built:
        if tool.name in tools:
            raise ValueError(f"two tools are called {tool.name!r}")
        tools[tool.name] = tool
    for tool in built:
        for alias in getattr(tool, "aliases", ()):
            tools.setdefault(alias, tool)
    return tools


def prepare_tools(tools: dict[str, Tool], state: TrajectoryState | None) -> None:
    """The trajectory of `state` begins (None: the run begins): call `prepare(state)` of each tool that has one
    (once per tool), e.g. the python tool starts its workers and fills its warm pool of interpreters while the
    engines start or decode."""
    for tool in {id(tool): tool for tool in tools.values()}.values():
        prepare = getattr(tool, "prepare", None)
        if callable(prepare):
            prepare(state)


def release_tools(tools: dict[str, Tool], state: TrajectoryState) -> None:
    """The trajectory of `state` ended: call `release(state)` of each tool that has one (once per tool, also
    when it has several names). A failing release is ignored: what it holds is freed when the tool closes."""
    for tool in {id(tool): tool for tool in tools.values()}.values():
        release = getattr(tool, "release", None)
        if callable(release):
            try:
                release(state)
            except Exception:
                pass


def tool_schemas(tools: dict[str, Tool]) -> list[dict[str, Any]]:
    """The schemas to hand the chat template (`apply_chat_template(..., tools=...)`): each tool once, under its
    own name."""
    return [tool.schema for name, tool in tools.items() if name == tool.name]
