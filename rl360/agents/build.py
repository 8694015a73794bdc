"""The agent of a run, from its config: tools, parser and loop settings, names checked against the registries."""

from __future__ import annotations

from dataclasses import dataclass

from rl360.agents.loop import AgentSettings
from rl360.agents.parsers import Parser, get_parser
from rl360.agents.tools import Tool, ToolSettings, build_tools
from rl360.config import ConfigError, RunConfig


@dataclass(frozen=True)
class Agent:
    tools: dict[str, Tool]
    parser: Parser
    settings: AgentSettings


def agent_from_config(cfg: RunConfig) -> Agent | None:
    """The run's agent (None when `agent.loop` is "": single-turn); `ConfigError` naming the key of an unknown
    parser or tool."""
    section = cfg.agent
    if not section.loop:
        return None
    try:
        parser = get_parser(section.parser)
    except (KeyError, ImportError, AttributeError, TypeError) as error:
        raise ConfigError(f"agent.parser={section.parser!r}: {str(error).strip(chr(34))}") from None
    tool_settings = ToolSettings(timeout_s=section.tool_timeout_s, memory_mb=section.tool_memory_mb,
                                 max_output_chars=section.max_tool_output_chars, max_pixels=section.max_pixels,
                                 min_pixels=section.min_pixels, max_image_tokens=section.max_image_tokens,
                                 python=section.python)
    try:
        tools = build_tools(list(section.tools), tool_settings)
    except (KeyError, ImportError, AttributeError, TypeError, ValueError) as error:
        raise ConfigError(f"agent.tools={list(section.tools)}: {str(error).strip(chr(34))}") from None
    if "python" in tools:
        _announce_tool_python(section.python)
    settings = AgentSettings(max_turns=section.max_turns, max_response_length=cfg.rollout.max_response_length,
                             tool_timeout_s=section.tool_timeout_s, min_pixels=section.min_pixels,
                             max_pixels=section.max_pixels)
    return Agent(tools, parser, settings)


def _announce_tool_python(configured: str) -> None:
    """One line when the python tool's interpreter lacks PIL or numpy: the images would not reach the model's code."""
    from rl360.agents.tools.python_env import missing_modules
    from rl360.rewards.sandbox import IsolationError, sandbox_python

    python = configured or sandbox_python()
    try:
        missing = missing_modules(python, ("PIL", "numpy")) if python else ["python"]
    except IsolationError:  # the sandbox refuses to run code here: the python tool says so at its first call
        return
    if missing:
        print(f"agent.tools: the python tool's interpreter {python or '(none)'} cannot import {missing} in the "
              "sandbox, so image_clue_0, ... are not loaded: make one with `python -m rl360.agents.tools.python_env "
              "DIR` and set agent.python=DIR/bin/python", flush=True)
