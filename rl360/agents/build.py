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
                                 python=section.python, workers=section.tool_workers)
    try:
        tools = build_tools(list(section.tools), tool_settings)
    except (KeyError, ImportError, AttributeError, TypeError, ValueError) as error:
        raise ConfigError(f"agent.tools={list(section.tools)}: {str(error).strip(chr(34))}") from None
    settings = AgentSettings(max_turns=section.max_turns, max_response_length=cfg.rollout.max_response_length,
                             tool_timeout_s=section.tool_timeout_s, min_pixels=section.min_pixels,
                             max_pixels=section.max_pixels)
    return Agent(tools, parser, settings)
