"""Tools an agent calls: the protocol and registry (base.py) and the built-ins, registered on import."""

from rl360.agents.tools import python, zoom  # noqa: F401  (registers the built-ins)
from rl360.agents.tools.base import (
    Tool,
    ToolReply,
    ToolSettings,
    TrajectoryState,
    build_tools,
    get_tool,
    register_tool,
    registered_tools,
    release_tools,
    tool_schemas,
)

__all__ = ["Tool", "ToolReply", "ToolSettings", "TrajectoryState", "build_tools", "get_tool", "register_tool",
           "registered_tools", "release_tools", "tool_schemas"]
