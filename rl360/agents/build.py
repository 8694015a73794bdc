"""The agent of a run, from its config: tools, parser and loop settings, names checked against the registries."""

from __future__ import annotations

import os
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
    if section.stop_after_call and not getattr(parser, "call_end", ""):
        raise ConfigError(f"agent.stop_after_call=true: the parser {section.parser!r} names no call_end (the text "
                          "that closes a call); set it on the parser function or agent.stop_after_call=false")
    tool_settings = ToolSettings(timeout_s=section.tool_timeout_s, memory_mb=section.tool_memory_mb,
                                 max_output_chars=section.max_tool_output_chars, max_pixels=section.max_pixels,
                                 min_pixels=section.min_pixels, max_image_tokens=section.max_image_tokens,
                                 python=section.python, workers=section.tool_workers,
                                 pool=section.tool_pool, replay=section.python_replay)
    try:
        tools = build_tools(list(section.tools), tool_settings)
    except (KeyError, ImportError, AttributeError, TypeError, ValueError) as error:
        raise ConfigError(f"agent.tools={list(section.tools)}: {str(error).strip(chr(34))}") from None
    if "python" in tools and _takes_images(cfg.model.path):  # a text model's trajectories hold no images
        _announce_tool_python(section.python)
    settings = AgentSettings(max_turns=section.max_turns, max_response_length=cfg.rollout.max_response_length,
                             tool_timeout_s=section.tool_timeout_s, min_pixels=section.min_pixels,
                             max_pixels=section.max_pixels, stop_after_call=section.stop_after_call,
                             batch_turns=section.batch_turns, max_turn_tokens=section.max_turn_tokens)
    _check_pixel_bounds(cfg)
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


def _takes_images(model_path: str) -> bool:
    from rl360.data.images import is_vision_model

    return os.path.isdir(model_path) and is_vision_model(model_path)


def _check_pixel_bounds(cfg: RunConfig) -> None:
    """A tool's image is resized within `agent.min_pixels` ... `agent.max_pixels` and written as that many image
    tokens; the engines and the trainer expand it by the model's processor bounds, which must keep it as it is:
    a vision model's processor bounds must contain the agent's (`ConfigError` naming both otherwise)."""
    from rl360.data.images import VisionProcessor

    if not _takes_images(cfg.model.path):
        return
    try:
        processor = VisionProcessor.from_pretrained(cfg.model.path, min_pixels=cfg.model.min_pixels or None,
                                                    max_pixels=cfg.model.max_pixels or None)
    except OSError:  # no image processor in the directory: the model directory's own check says so
        return
    agent = cfg.agent
    if agent.min_pixels < processor.min_pixels or agent.max_pixels > processor.max_pixels:
        raise ConfigError(f"agent.min_pixels={agent.min_pixels}, agent.max_pixels={agent.max_pixels}: a tool's images "
                          f"must stay within the model's image bounds ({processor.min_pixels} ... "
                          f"{processor.max_pixels} pixels, model.min_pixels / model.max_pixels or its "
                          "preprocessor_config.json); set agent.min_pixels / agent.max_pixels inside them")
