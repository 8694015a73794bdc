"""Agents: multi-turn rollouts in which the policy calls tools.

`run_agent` (loop.py) turns one prompt into one trajectory `Sample`: generate a turn, parse its tool calls
(parsers.py), run the tools (tools/), append their replies (replies.py) as the chat template renders them (loss mask 0),
generate again, up to `agent.max_turns` turns and `rollout.max_response_length` response tokens.
`agent_metrics` (metrics.py) summarises a batch of trajectories. This room is engine-agnostic: it gets a
`generate_turn` function and never imports the rollout room.
"""

from rl360.agents.loop import AgentSettings, run_agent
from rl360.agents.metrics import agent_metrics
from rl360.agents.parsers import ParseResult, ToolCall, get_parser, register_parser

__all__ = ["AgentSettings", "ParseResult", "ToolCall", "agent_metrics", "get_parser", "register_parser",
           "run_agent"]
